"""``MegaseqWorker``: what the ``vllm`` engine asks of vLLM's workers, as methods vLLM mixes into its worker
class (``worker_extension_cls``) and the engine calls by name through ``LLM.collective_rpc``.

By name, because vLLM's V1 engine sends a ``collective_rpc`` call to its worker processes with msgpack and
refuses to pickle a function unless insecure serialisation is switched on for the whole process
(``VLLM_ALLOW_INSECURE_SERIALIZATION``). For the same reason arguments and results are plain data: new
weights travel as the path of a safetensors file the engine wrote (one copy on disk instead of tensors
through the message queue), routing comes back as nested lists of ints.
"""

from __future__ import annotations

from safetensors.torch import load_file

from megaseq_rl.vllm.translate import to_vllm_names


class MegaseqWorker:
    def megaseq_load_weights(self, path: str) -> None:
        """Load megaseq-named weights from the safetensors file at ``path`` into the served model."""
        self.model_runner.model.load_weights(to_vllm_names(load_file(path)))

    def megaseq_routing(self) -> dict[str, list[list[int]]]:
        """Experts ``[T, k]`` per MoE layer for every position fed since the last prompt."""
        return {key: idx.tolist() for key, idx in self.model_runner.model.routing_of_sequence().items()}
