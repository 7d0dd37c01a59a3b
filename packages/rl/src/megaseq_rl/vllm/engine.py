"""The ``vllm`` inference engine: ``megaseq.inference.InferenceEngine`` over ``vllm.LLM``. CUDA only; never run
on this project's machines (see the package README for what has and has not run).

The model is exported once into a temporary vLLM model directory (``translate.export_model_dir``) and served
by ``MegaseqForCausalLM`` (``megaseq_rl.vllm.model``), one sequence at a time; new weights go to the worker
through ``LLM.collective_rpc`` under vLLM's names. Log-probabilities are requested as vLLM's
``processed_logprobs`` (after temperature scaling), which is megaseq's contract, ``log softmax(logits / T)``,
if vLLM applies top-p after computing them (unverified: nothing here has run). Routing is read back from
the worker after each sequence. Rows are seeded ``seed + row``.
"""

from __future__ import annotations

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
from megaseq_rl.vllm.translate import TORCH_DTYPES, export_model_dir, to_vllm_names


def _load_weights(worker, weights: dict[str, Tensor]) -> None:
    worker.model_runner.model.load_weights(to_vllm_names(weights))


def _routing(worker) -> dict[str, Tensor]:
    return worker.model_runner.model.routing_of_sequence()


class VLLMEngine:
    def __init__(self, config: VLLMEngineConfig, recipe: Recipe, plugins: Plugins) -> None:
        try:
            import vllm
        except ImportError:
            raise UserError("engine 'vllm' needs vLLM (CUDA): pip install 'megaseq-rl[vllm]'; or use engine 'cached'") from None
        if not torch.cuda.is_available():
            raise UserError("engine 'vllm' needs a CUDA device (vLLM's wheels are CUDA builds); use engine 'cached' on CPU")
        self.vllm = vllm
        self.vocab_size = recipe.model.vocab_size
        self.max_model_len = config.max_model_len
        self.directory = Path(tempfile.mkdtemp(prefix="megaseq-vllm-"))
        export_model_dir(build_model(recipe, plugins).state_dict(), recipe.to_dict(), self.directory, config.dtype, config.max_model_len)
        self.llm = vllm.LLM(
            model=str(self.directory),
            skip_tokenizer_init=True,
            dtype=TORCH_DTYPES[config.dtype],
            max_model_len=config.max_model_len,
            max_num_seqs=1,
            enable_chunked_prefill=False,
            enable_prefix_caching=False,
            enforce_eager=config.enforce_eager,
            gpu_memory_utilization=config.gpu_memory_utilization,
            tensor_parallel_size=config.tensor_parallel_size,
            logprobs_mode="processed_logprobs",
        )

    def update_weights(self, weights: Mapping[str, Tensor]) -> None:
        self.llm.collective_rpc(_load_weights, args=({k: v.detach().cpu() for k, v in weights.items()},))

    def _params(self, params: SamplingParams, seed: int, **extra):
        return self.vllm.SamplingParams(
            n=1, temperature=params.temperature, top_p=params.top_p, seed=seed, max_tokens=params.max_new_tokens,
            min_tokens=0 if params.stop_token is not None else params.max_new_tokens, ignore_eos=True,
            stop_token_ids=[params.stop_token] if params.stop_token is not None else None, detokenize=False, **extra,
        )

    def generate(self, prompts: Tensor, params: SamplingParams) -> Generation:
        check_tokens(prompts, self.vocab_size, "vllm engine: prompts")
        batch, prompt_len = prompts.shape
        n = params.max_new_tokens
        if prompt_len + n > self.max_model_len:
            raise UserError(f"vllm engine: prompt of {prompt_len} tokens + max_new_tokens {n} exceeds max_model_len {self.max_model_len}")
        tokens = torch.zeros(batch, n, dtype=torch.int64)
        logprobs = torch.zeros(batch, n)
        mask = torch.zeros(batch, n, dtype=torch.bool)
        truncated = torch.zeros(batch, dtype=torch.bool)
        routing: dict[str, list[Tensor]] = {}
        for row in range(batch):  # one sequence at a time (see megaseq_rl.vllm.model); rows seeded independently
            (out,) = self.llm.generate(
                [{"prompt_token_ids": prompts[row].tolist()}], self._params(params, params.seed + row, logprobs=0), use_tqdm=False
            )
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            tokens[row, : len(ids)] = torch.tensor(ids)
            logprobs[row, : len(ids)] = torch.tensor([step[t].logprob for step, t in zip(completion.logprobs, ids, strict=True)])
            mask[row, : len(ids)] = True
            truncated[row] = params.stop_token is not None and (not ids or ids[-1] != params.stop_token)
            per_layer = self.llm.collective_rpc(_routing)[0]
            for key, idx in per_layer.items():
                idx = idx[: prompt_len + n - 1]
                if idx.shape[0] < prompt_len + n - 1:  # a stopped row: pad as never fed
                    idx = torch.cat([idx, idx[-1:].expand(prompt_len + n - 1 - idx.shape[0], -1)])
                routing.setdefault(key, []).append(idx)
        return Generation(tokens, logprobs, mask, truncated, {k: torch.stack(v) for k, v in routing.items()})

    def score(self, tokens: Tensor, temperature: float = 1.0) -> Tensor:
        check_tokens(tokens, self.vocab_size, "vllm engine: score")
        params = self.vllm.SamplingParams(max_tokens=1, temperature=temperature, prompt_logprobs=0, detokenize=False)
        rows = []
        for row in tokens:
            (out,) = self.llm.generate([{"prompt_token_ids": row.tolist()}], params, use_tqdm=False)
            ids = row.tolist()
            rows.append(torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]))
        return torch.stack(rows)


def build(config: VLLMEngineConfig, recipe: Recipe, plugins: Plugins) -> VLLMEngine:
    return VLLMEngine(config, recipe, plugins)
