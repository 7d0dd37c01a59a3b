"""Serving megaseq models through vLLM (optional extra ``megaseq-rl[vllm]``; vLLM's wheels are CUDA builds).

- ``translate``: a megaseq checkpoint as a vLLM model directory: ``config.json`` (architecture
  ``MegaseqForCausalLM``, the megaseq recipe inside) and ``model.safetensors`` under vLLM's weight names.
  Torch and megaseq only: tested on CPU.
- ``register``: the ``vllm.general_plugins`` entry point; names the model class for vLLM's registry
  (lazily, by its import path). Tested on CPU against vLLM's entry-point contract, not inside vLLM.
- ``model``: ``MegaseqForCausalLM``, the vLLM model class: megaseq's own layers with their own caches,
  one sequence at a time. CUDA only; never run on this project's machines.
- ``engine``: the ``vllm`` inference engine (``megaseq.inference.InferenceEngine`` over ``vllm.LLM``). CUDA only.
"""
