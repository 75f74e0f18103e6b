"""KV-head merging: G key/value heads become K, each merged head serving the query heads of the
heads merged into it, so the KV cache shrinks by G/K and the result is a plain GQA config
(`num_key_value_heads = K`) that every engine serves with its normal attention.

For one attention layer (head width d, m = G/K heads per merged group):

1. Which heads merge: `balanced_groups` clusters the KV heads by the similarity of their key
   and value outputs on the calibration tokens into K groups of exactly m heads.
2. How they merge:
   mean     the shared k_proj / v_proj rows are the members' mean (the GQA paper's conversion).
   aligned  values: the shared value head spans the top-d principal directions of the members'
            stacked value outputs (from E[xx^T]), and o_proj is refit by least squares so the
            attention block reproduces its original output from the merged heads' attention
            outputs on calibration tokens (per query head, the correction that maps the shared
            head's output back onto its member's; solved for all heads at once, so the block's
            output error, not each head's, is what is minimized).
            keys: a correction folded into q_proj must commute with RoPE, so it can only scale
            and rotate each rotary frequency pair (i, i + d/2): a complex number per pair. Per
            pair the shared key is the best complex rank-1 fit of the members' keys, weighted by
            the energy of the queries that read each member (errors on pairs the queries barely
            use cost little), and each query head is multiplied by the conjugate of its
            member's complex factor.
3. The query heads (q_proj rows, o_proj columns) are reordered so merged head g serves the
   query heads of its members, contiguously, as grouped-query attention expects.

HF's rotary convention is assumed: dimension i is rotated with i + d/2 (`rotate_half`).
Written here because no library merges attention heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from compressors.structured import _linear
from pipelines.errors import require

METHODS = ("mean", "aligned")


# --------------------------------------------------------------------------- which heads merge


class AttentionInputStatistics:
    """What the merge reads of the calibration tokens at one attention layer: E[x x^T] and E[x]
    of its input (the input q/k/v read), and the token-averaged cosine similarity between every
    pair of KV heads' keys and values. `inputs`: the attention's (args, kwargs) per batch."""

    def __init__(self, attention: nn.Module, inputs: list[tuple[tuple, dict]]):
        from calibrate.stats import HeadSimilarity, Moments

        kv_heads = attention.k_proj.out_features // attention.head_dim
        self.moments = Moments(attention.k_proj.in_features)
        similarity = {"k": HeadSimilarity(kv_heads, attention.head_dim), "v": HeadSimilarity(kv_heads, attention.head_dim)}
        with torch.no_grad():
            for call in inputs:
                x = attention_call(call)[0]
                self.moments.add(x)
                similarity["k"].add(attention.k_proj(x))
                similarity["v"].add(attention.v_proj(x))
        self.head_similarity = sum(s.total / s.count for s in similarity.values()) / 2

    @property
    def second_moment(self) -> torch.Tensor:
        return self.moments.second_moment()

    @property
    def mean(self) -> torch.Tensor:
        return self.moments.sum / self.moments.count


def balanced_groups(similarity: torch.Tensor | None, n_groups: int, heads: int, seed: int = 0) -> list[list[int]]:
    """Partition `heads` heads into `n_groups` groups of equal size, similar heads together by
    a [G, G] similarity matrix (cosine, in [-1, 1]; not needed when every head goes to one
    group or each to its own). scikit-learn clusters (a spectral embedding of the affinity,
    k-means on it) but has no equal-size constraint, so each k-means step's assignment is
    replaced by a balanced one: the optimal matching of heads to G/K copies of each centre
    (scipy's Hungarian solver)."""
    from scipy.optimize import linear_sum_assignment
    from sklearn.cluster import KMeans
    from sklearn.manifold import spectral_embedding

    size = heads // n_groups
    if n_groups == 1 or size == 1:
        return [list(range(g * size, (g + 1) * size)) for g in range(n_groups)]
    affinity = ((similarity.double() + similarity.double().T) / 4 + 0.5).clamp_min(1e-6).numpy()  # [0, 1], symmetric
    points = spectral_embedding(affinity, n_components=n_groups, drop_first=False, random_state=seed)
    centres = KMeans(n_groups, n_init=10, random_state=seed).fit(points).cluster_centers_
    labels = None
    for _ in range(100):
        cost = ((points[:, None, :] - np.repeat(centres, size, axis=0)[None]) ** 2).sum(-1)
        _, slot = linear_sum_assignment(cost)
        new_labels = slot // size
        if labels is not None and (new_labels == labels).all():
            break
        labels = new_labels
        centres = np.stack([points[labels == g].mean(0) for g in range(n_groups)])
    groups = [sorted(np.flatnonzero(labels == g).tolist()) for g in range(n_groups)]
    return sorted(groups)


# --------------------------------------------------------------------------- the heads as tensors


@dataclass
class AttentionHeads:
    """One layer's projections per head, with the bias as a last input column when present
    (so E[x x^T] augmented with the mean covers it): q [H, d, n'], k and v [G, d, n'],
    o [hidden, H, d] with its own bias."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    o_bias: torch.Tensor | None
    has_bias: bool

    @classmethod
    @torch.no_grad()
    def of(cls, attention: nn.Module, heads: int, kv_heads: int, head_dim: int) -> "AttentionHeads":
        biases = {linear.bias is not None for linear in (attention.q_proj, attention.k_proj, attention.v_proj)}
        require(len(biases) == 1, "kv-merge needs q_proj, k_proj and v_proj all with a bias or all without")
        has_bias = biases.pop()

        def per_head(linear: nn.Linear, count: int) -> torch.Tensor:
            weight = linear.weight.double()
            if has_bias:
                weight = torch.cat([weight, linear.bias.double()[:, None]], dim=1)
            return weight.reshape(count, head_dim, -1)

        o = attention.o_proj.weight.double().reshape(-1, heads, head_dim)
        o_bias = attention.o_proj.bias.detach().clone() if attention.o_proj.bias is not None else None
        return cls(per_head(attention.q_proj, heads), per_head(attention.k_proj, kv_heads), per_head(attention.v_proj, kv_heads), o, o_bias, has_bias)

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.q.shape[0], self.k.shape[0], self.q.shape[1]

    def augment(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, torch.ones_like(x[..., :1])], dim=-1) if self.has_bias else x

    def input_moment(self, statistics: AttentionInputStatistics) -> torch.Tensor:
        """E[x' x'^T] of the (augmented) input."""
        sigma = statistics.second_moment.double()
        if not self.has_bias:
            return sigma
        mean = statistics.mean.double()
        return torch.cat([torch.cat([sigma, mean[:, None]], 1), torch.cat([mean, torch.ones(1, dtype=torch.float64)])[None]], 0)

    @torch.no_grad()
    def write(self, attention: nn.Module, dtype: torch.dtype) -> None:
        """Replace the layer's projections with these heads' (new shapes, same dtype)."""

        def linear(per_head: torch.Tensor) -> nn.Linear:
            flat = per_head.reshape(-1, per_head.shape[-1])
            weight, bias = (flat[:, :-1], flat[:, -1]) if self.has_bias else (flat, None)
            return _linear(weight.to(dtype), None if bias is None else bias.to(dtype))

        attention.q_proj, attention.k_proj, attention.v_proj = linear(self.q), linear(self.k), linear(self.v)
        attention.o_proj = _linear(self.o.reshape(self.o.shape[0], -1).to(dtype), self.o_bias)


# --------------------------------------------------------------------------- how they merge


def _top_eigenvectors(matrix: torch.Tensor, count: int) -> torch.Tensor:
    """The `count` leading eigenvectors (columns, largest first) of Hermitian matrices [..., n, n],
    each with a fixed phase (largest entry real positive) so results are reproducible."""
    _, vectors = torch.linalg.eigh(matrix)
    vectors = vectors[..., -count:].flip(-1)
    pivot = vectors.gather(-2, vectors.abs().argmax(dim=-2, keepdim=True))
    return vectors * (pivot.conj() / pivot.abs().clamp_min(1e-300))


def _complex_pairs(rows: torch.Tensor) -> torch.Tensor:
    """[..., d, n] real rows -> [..., d/2, n] complex: row i + 1j * row i + d/2 (a rotary pair)."""
    half = rows.shape[-2] // 2
    return torch.complex(rows[..., :half, :], rows[..., half:, :])


def _real_pairs(pairs: torch.Tensor) -> torch.Tensor:
    return torch.cat([pairs.real, pairs.imag], dim=-2)


def shared_key(keys: torch.Tensor, sigma: torch.Tensor, query_energy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Members' key rows [m, d, n'] -> (shared key rows [d, n'], complex factors c [m, d/2]) with
    key_j ≈ c_j * shared per rotary pair, minimizing sum_j w_j E|key_j - c_j shared|^2 where w_j
    [m, d/2] is the energy of the queries reading member j in that pair."""
    wc = _complex_pairs(keys)  # [m, p, n']
    covariance = torch.einsum("jpn,lpn->pjl", wc.conj(), wc @ sigma.to(wc.dtype))  # E[conj(K_j) K_l] per pair
    scale = (query_energy / query_energy.mean().clamp_min(1e-30)).clamp_min(1e-6).sqrt().T  # [p, m]
    weighted = scale[:, :, None] * covariance * scale[:, None, :]
    top = _top_eigenvectors(weighted, 1)[..., 0]  # [p, m], unit norm
    shared = torch.einsum("pj,jpn->pn", scale * top, wc)  # k_s = sum_j s_j v_j K_j
    factors = (top.conj() / scale).T  # K_j ≈ conj(v_j) / s_j * k_s
    return _real_pairs(shared), factors


def member_query_energy(queries: list[torch.Tensor], sigma: torch.Tensor) -> torch.Tensor:
    """Per member (its query rows [r, d, n']), E|Q_i|^2 summed over its query heads, per rotary
    pair i: [m, d/2], the weights of `shared_key`."""
    energy = torch.stack([(rows @ sigma * rows).sum(-1).sum(0) for rows in queries])  # [m, d]: E[q_i^2]
    half = energy.shape[1] // 2
    return energy[:, :half] + energy[:, half:]


def reconstructed_keys(shared: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """Each member's key rows as the merge represents them, c_j * shared per pair: [m, d, n']."""
    return _real_pairs(factors[:, :, None] * _complex_pairs(shared)[None])


def rotate_queries(queries: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """Query rows [r, d, n'] of heads whose key became c * shared key (c [d/2] complex, per pair):
    q' = conj(c) q per pair, so q'·RoPE(shared) = q·RoPE(c shared) at every position."""
    return _real_pairs(factor.conj()[None, :, None] * _complex_pairs(queries))


def shared_value(values: torch.Tensor, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Members' value rows [m, d, n'] -> (shared rows [d, n'], maps U [m, d, d]) with
    value_j ≈ U_j shared: the top-d principal directions of the stacked value outputs."""
    m, d, n = values.shape
    stacked = values.reshape(m * d, n)
    basis = _top_eigenvectors(stacked @ sigma @ stacked.T, d)  # [m d, d]
    return basis.T @ stacked, basis.reshape(m, d, d)


def merge_heads(heads: AttentionHeads, groups: list[list[int]], method: str, sigma: torch.Tensor | None) -> tuple[AttentionHeads, list[int]]:
    """The merged layer's heads and the query-head order (new position -> original head)."""
    n_heads, kv_heads, _ = heads.shape
    per_kv = n_heads // kv_heads
    order, q, k, v, o = [], [], [], [], []
    for members in groups:
        member_queries = [heads.q[j * per_kv : (j + 1) * per_kv] for j in members]
        member_out = [heads.o[:, j * per_kv : (j + 1) * per_kv] for j in members]
        if method == "mean":
            k.append(heads.k[members].mean(0))
            v.append(heads.v[members].mean(0))
        else:
            key, factors = shared_key(heads.k[members], sigma, member_query_energy(member_queries, sigma))
            value, maps = shared_value(heads.v[members], sigma)
            k.append(key)
            v.append(value)
            member_queries = [rotate_queries(rows, c) for rows, c in zip(member_queries, factors)]
            member_out = [cols @ u for cols, u in zip(member_out, maps)]  # closed form; OutputRefit improves it
        order += [j * per_kv + i for j in members for i in range(per_kv)]
        q += member_queries
        o += member_out
    merged = AttentionHeads(torch.cat(q), torch.stack(k), torch.stack(v), torch.cat(o, dim=1), heads.o_bias, heads.has_bias)
    return merged, order


# --------------------------------------------------------------------------- o_proj refit on calibration tokens


def attention_call(call: tuple[tuple, dict]) -> tuple:
    """A captured attention call (args, kwargs), as HF decoder layers make it, as the
    (x, cos, sin, mask) that `attention_outputs` takes."""
    _, kwargs = call
    return (kwargs["hidden_states"], *kwargs["position_embeddings"], kwargs.get("attention_mask"))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def attention_outputs(heads: AttentionHeads, x: torch.Tensor, cos, sin, mask, scaling: float, softcap: float | None) -> torch.Tensor:
    """Per-head attention outputs [B, T, H, d] (before o_proj) of causal self-attention on the
    attention input x [B, T, n], with the layer's rotary cos/sin and mask as the model passes them
    (None: causal; bool: True attends; float: added to the scores)."""
    n_heads, kv_heads, head_dim = heads.shape
    batch, tokens, _ = x.shape
    x = heads.augment(x.float())

    def project(rows: torch.Tensor) -> torch.Tensor:
        return (x @ rows.float().reshape(-1, rows.shape[-1]).T).reshape(batch, tokens, rows.shape[0], head_dim).transpose(1, 2)

    cos, sin = cos.float()[:, None], sin.float()[:, None]
    queries, keys, values = _rope(project(heads.q), cos, sin), _rope(project(heads.k), cos, sin), project(heads.v)
    keys = keys.repeat_interleave(n_heads // kv_heads, dim=1)
    values = values.repeat_interleave(n_heads // kv_heads, dim=1)
    if mask is not None:
        mask = mask[..., :tokens, :tokens] if mask.dtype == torch.bool else mask[..., :tokens, :tokens].float()
    if not softcap:  # torch's fused attention
        out = torch.nn.functional.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, is_causal=mask is None, scale=scaling)
        return out.transpose(1, 2)
    scores = torch.tanh(queries @ keys.transpose(-1, -2) * scaling / softcap) * softcap  # Gemma 2's logit soft-capping
    if mask is None:
        mask = torch.ones(tokens, tokens, dtype=torch.bool).tril()
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return (scores.softmax(dim=-1) @ values).transpose(1, 2)


class OutputRefit:
    """Accumulates E[o z^T] and E[z z^T] over calibration batches, where o are the original
    layer's per-head attention outputs (in the merged query order) and z the merged layer's;
    `solve` gives the o_proj minimizing E||W_o o - W' z||^2 + damp ||W' - W_0||^2, a ridge
    toward the closed-form o_proj W_0 (so where the merge is lossless, the refit is too)."""

    def __init__(self, original: AttentionHeads, merged: AttentionHeads, order: list[int], scaling: float, softcap: float | None):
        self.original, self.merged, self.order = original, merged, order
        self.scaling, self.softcap = scaling, softcap
        width = merged.q.shape[0] * merged.q.shape[1]
        self.cross = torch.zeros(width, width, dtype=torch.float64)
        self.gram = torch.zeros(width, width, dtype=torch.float64)

    @torch.no_grad()
    def add(self, call: tuple[tuple, dict]) -> None:
        """One captured attention call (a calibration batch)."""
        o = attention_outputs(self.original, *attention_call(call), self.scaling, self.softcap)[:, :, self.order].flatten(2).flatten(0, 1).double()
        z = attention_outputs(self.merged, *attention_call(call), self.scaling, self.softcap).flatten(2).flatten(0, 1).double()
        self.cross += o.T @ z
        self.gram += z.T @ z

    def solve(self, damp: float) -> torch.Tensor:
        """o_proj weights [hidden, H, d] for the merged heads; `damp` relative to the mean diagonal."""
        target = self.original.o[:, self.order].flatten(1)
        closed_form = self.merged.o.flatten(1)
        ridge = damp * self.gram.diagonal().mean()
        gram = self.gram + ridge * torch.eye(self.gram.shape[0], dtype=torch.float64)
        refit = torch.linalg.solve(gram, self.cross.T @ target.T + ridge * closed_form.T).T
        return refit.reshape(self.merged.o.shape)
