"""The context-extension experiment: its plan, its stages, its report and the `megaseq context-extension` command."""
