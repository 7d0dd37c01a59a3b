"""Experiments: several training runs and evaluations compared in one report."""
