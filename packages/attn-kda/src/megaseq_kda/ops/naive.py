"""The KDA oracle: the recurrence run one token at a time, exactly as written in the paper.

Per head, with state S in R^{K x V}:

    S'  = Diag(exp(g_t)) S_{t-1}
    S_t = S' + beta_t k_t (v_t - S'^T k_t)^T
    o_t = S_t^T (scale q_t)

Slow (a Python loop over tokens) and obviously correct; every fast path is tested against it.
Computes in fp32, or in float64 when given float64 inputs.
"""

import torch

from megaseq.documents import Documents
from megaseq.dtypes import compute_dtype
from megaseq_kda.ops.inputs import check_kda_inputs


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | Documents | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA. Returns ``(o [B, T, H, V], final_state [N, H, K, V] or None)``.

    With ``cu_seqlens`` each document is run on its own from its own initial state.
    """
    documents, _ = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    if documents is not None:
        outputs, finals = [], []
        for doc, (start, end) in enumerate(documents.bounds):
            doc_state = None if initial_state is None else initial_state[doc : doc + 1]
            o, final = naive_recurrent_kda(
                *(x[:, start:end] for x in (q, k, v, g, beta)), scale, doc_state, output_final_state=True
            )
            outputs.append(o)
            finals.append(final)
        return torch.cat(outputs, 1), torch.cat(finals) if output_final_state else None

    B, T, H, K = q.shape
    scale = K**-0.5 if scale is None else scale
    out_dtype, dtype = q.dtype, compute_dtype(q.dtype)
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    S = q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state.to(dtype)
    outputs = []
    for t in range(T):
        k_t = k[:, t, :, :, None]  # [B, H, K, 1]
        S = g[:, t, :, :, None].exp() * S
        S = S + beta[:, t, :, None, None] * k_t * (v[:, t, :, None, :] - (k_t * S).sum(-2, keepdim=True))
        outputs.append((scale * q[:, t, :, :, None] * S).sum(-2))
    o = torch.stack(outputs, 1) if outputs else v.new_zeros(v.shape)
    return o.to(out_dtype), S if output_final_state else None
