"""Structured pruning: remove whole MLP channels, whole attention head groups or whole decoder
layers, so the result is a smaller dense model that needs no special kernel.

Units and their scores (higher = keep):
  - an MLP channel j: row j of gate_proj and up_proj, column j of down_proj;
  - a head group g: KV head g with the query heads that share it (rows of q/k/v, columns of
    o_proj), so grouped-query attention keeps its query-per-KV ratio;
  - a decoder layer: by block influence, 1 - cos(layer input, layer output) averaged over the
    calibration tokens (ShortGPT): a layer that barely turns the hidden state does little.
Scorers, from the statistics of the input to down_proj / o_proj (x, one entry per channel):
  flap       Var[x_j] * ||W[:, j]||^2 (FLAP's fluctuation: what a channel adds beyond its mean,
             which bias compensation puts back)
  wanda-sp   ||X_j|| * sum_i |W[i, j]| (Wanda's score summed over the channel's weights)
  magnitude  the L2 norm of every weight the unit owns (the naive baseline)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pipelines.errors import require
from pipelines.models import head_dim_of

SCORERS = ("flap", "wanda-sp", "magnitude")


def _column_score(weight: torch.Tensor, stats, scorer: str) -> torch.Tensor:
    """Per input channel of a linear [out, in] (its input statistics `stats`)."""
    w = weight.float()
    if scorer == "flap":
        return stats.channel_variance * (w**2).sum(dim=0)
    return stats.second_moment.diagonal().clamp_min(0).sqrt() * w.abs().sum(dim=0)  # wanda-sp


@torch.no_grad()
def mlp_channel_scores(mlp: nn.Module, down_stats, scorer: str) -> torch.Tensor:
    if scorer == "magnitude":
        return ((mlp.gate_proj.weight.float() ** 2).sum(1) + (mlp.up_proj.weight.float() ** 2).sum(1) + (mlp.down_proj.weight.float() ** 2).sum(0)).sqrt()
    return _column_score(mlp.down_proj.weight, down_stats, scorer)


@torch.no_grad()
def head_group_scores(attention: nn.Module, o_stats, config, scorer: str) -> torch.Tensor:
    """One score per KV head: the sum over the o_proj input channels of its query group (for
    magnitude, the norm of every q/k/v row and o column the group owns)."""
    groups = config.num_key_value_heads
    if scorer == "magnitude":
        per_group = lambda t: t.reshape(groups, -1).sum(dim=1)  # noqa: E731
        squares = (
            per_group((attention.q_proj.weight.float() ** 2).sum(1)) + per_group((attention.k_proj.weight.float() ** 2).sum(1))
            + per_group((attention.v_proj.weight.float() ** 2).sum(1)) + per_group((attention.o_proj.weight.float() ** 2).sum(0))
        )
        return squares.sqrt()
    return _column_score(attention.o_proj.weight, o_stats, scorer).reshape(groups, -1).sum(dim=1)


def groups_to_drop(config, keep_heads: int) -> int:
    """Head groups to drop so that `keep_heads` query heads stay per layer (whole groups only)."""
    per_group = config.num_attention_heads // config.num_key_value_heads
    valid = [per_group * g for g in range(1, config.num_key_value_heads + 1)]
    require(
        keep_heads in valid,
        f"{keep_heads} query heads would break grouped-query attention ({per_group} query heads share each KV head); "
        f"keep one of {', '.join(map(str, valid))}",
    )
    return config.num_key_value_heads - keep_heads // per_group


@dataclass(frozen=True)
class UnitCosts:
    """Parameters one unit of each kind holds in one layer."""

    channel: int
    group: int

    @staticmethod
    def of(config) -> "UnitCosts":
        head_dim, hidden = head_dim_of(config), config.hidden_size
        queries_per_group = config.num_attention_heads // config.num_key_value_heads
        return UnitCosts(channel=3 * hidden, group=(2 * queries_per_group + 2) * head_dim * hidden)


def removal_costs(scores: list[torch.Tensor], unit_params: int) -> list[torch.Tensor]:
    """Per unit: its score over the mean score of its kind, times its parameter count."""
    mean = torch.cat(scores).mean().clamp_min(1e-30)
    return [s / mean * unit_params for s in scores]


def uniform_allocation(
    channel_scores: list[torch.Tensor], group_scores: list[torch.Tensor], costs: UnitCosts, remove_params: int, drop_groups: int | None = None,
) -> tuple[int, int]:
    """How many MLP channels and head groups every layer loses (the same in each, so the model
    keeps one config): of the splits that remove at least `remove_params`, the one whose removed
    units cost least, a unit's cost being its score relative to the mean of its kind (over all
    layers) times its parameters: removing an average head group costs as much as removing
    average channels of the same size. `drop_groups` fixes the number of head groups instead."""
    layers = len(channel_scores)
    channels, groups = channel_scores[0].numel(), group_scores[0].numel()
    sorted_channels = [s.sort().values.cumsum(0) for s in removal_costs(channel_scores, costs.channel)]
    sorted_groups = [s.sort().values.cumsum(0) for s in removal_costs(group_scores, costs.group)]
    best = None
    for drop_groups in range(groups) if drop_groups is None else [drop_groups]:  # at least one group stays
        left = remove_params - drop_groups * costs.group * layers
        drop_channels = max(0, -(-left // (costs.channel * layers)))
        if drop_channels >= channels:
            continue
        cost = sum(float(g[drop_groups - 1]) if drop_groups else 0.0 for g in sorted_groups)
        cost += sum(float(c[drop_channels - 1]) if drop_channels else 0.0 for c in sorted_channels)
        if best is None or cost < best[0]:
            best = (cost, drop_channels, drop_groups)
    require(
        best is not None,
        "the target would remove every MLP channel or every head group of a layer; ask for a smaller reduction "
        "(e.g. --target-params 0.75) or drop whole layers with `lmpress drop-layers`",
    )
    return best[1], best[2]


def global_allocation(
    channel_scores: list[torch.Tensor], group_scores: list[torch.Tensor], costs: UnitCosts, remove_params: int,
) -> tuple[list[int], list[int]]:
    """Per layer, how many MLP channels and head groups it loses, when layers may differ:
    every unit of every layer in order of removal cost per parameter (`removal_costs`: its
    score relative to its kind's mean), the cheapest first, until `remove_params` are gone; a
    layer always keeps one channel and one head group (FLAP's global allocation)."""
    layers = len(channel_scores)
    units = [(float(c) / costs.channel, layer, 0) for layer, layer_costs in enumerate(removal_costs(channel_scores, costs.channel)) for c in layer_costs]
    units += [(float(c) / costs.group, layer, 1) for layer, layer_costs in enumerate(removal_costs(group_scores, costs.group)) for c in layer_costs]
    dropped = [[0] * layers, [0] * layers]  # [channels, groups][layer]
    limits = (channel_scores[0].numel() - 1, group_scores[0].numel() - 1)
    removed = 0
    for _, layer, kind in sorted(units):
        if removed >= remove_params:
            break
        if dropped[kind][layer] < limits[kind]:
            dropped[kind][layer] += 1
            removed += costs.group if kind else costs.channel
    require(
        removed >= remove_params,
        "the target would remove every MLP channel or every head group of a layer; ask for a smaller reduction "
        "(e.g. --target-params 0.75) or drop whole layers with `lmpress drop-layers`",
    )
    return dropped[0], dropped[1]


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype)
    layer.weight.data.copy_(weight)
    if bias is not None:
        layer.bias.data.copy_(bias)
    return layer


def _bias(linear: nn.Linear, compensation: torch.Tensor | None = None, present: bool = False) -> torch.Tensor | None:
    """The linear's bias after pruning: its own (zeros if it had none) plus `compensation`;
    None when it had none, gets none and need not be `present` (the config's bias flags
    give every linear of a block a bias, or none)."""
    if linear.bias is None and compensation is None and not present:
        return None
    bias = linear.bias.data.float().clone() if linear.bias is not None else torch.zeros(linear.out_features)
    return bias + compensation if compensation is not None else bias


def _rows(linear: nn.Linear, rows: torch.Tensor, present: bool) -> nn.Linear:
    bias = _bias(linear, present=present)
    return _linear(linear.weight.data[rows], None if bias is None else bias[rows])


@torch.no_grad()
def prune_mlp(mlp: nn.Module, keep: torch.Tensor, down_mean: torch.Tensor | None, biased: bool) -> None:
    """Keep MLP channels `keep` (sorted indices). With `down_mean` (E[x] of down_proj's input)
    the pruned channels' mean contribution W[:, pruned] E[x_pruned] goes into down_proj's bias
    (`biased`: the block's linears carry biases, as Llama's `mlp_bias` makes them)."""
    pruned = torch.ones(mlp.down_proj.in_features, dtype=torch.bool)
    pruned[keep] = False
    compensation = mlp.down_proj.weight.float()[:, pruned] @ down_mean[pruned].float() if down_mean is not None else None
    mlp.gate_proj, mlp.up_proj = _rows(mlp.gate_proj, keep, biased), _rows(mlp.up_proj, keep, biased)
    mlp.down_proj = _linear(mlp.down_proj.weight.data[:, keep], _bias(mlp.down_proj, compensation, biased))


@torch.no_grad()
def prune_heads(attention: nn.Module, keep_groups: torch.Tensor, config, o_mean: torch.Tensor | None, biased: bool) -> None:
    """Keep KV heads `keep_groups` (sorted) with their query groups; with `o_mean` the pruned
    heads' mean contribution goes into o_proj's bias (`biased`: Llama's `attention_bias`)."""
    head_dim, groups = head_dim_of(config), config.num_key_value_heads
    per_group = config.num_attention_heads // groups
    kv_rows = (keep_groups[:, None] * head_dim + torch.arange(head_dim)).flatten()
    q_rows = (keep_groups[:, None] * per_group * head_dim + torch.arange(per_group * head_dim)).flatten()
    pruned = torch.ones(attention.o_proj.in_features, dtype=torch.bool)
    pruned[q_rows] = False
    compensation = attention.o_proj.weight.float()[:, pruned] @ o_mean[pruned].float() if o_mean is not None else None
    attention.q_proj = _rows(attention.q_proj, q_rows, biased)
    attention.k_proj, attention.v_proj = _rows(attention.k_proj, kv_rows, biased), _rows(attention.v_proj, kv_rows, biased)
    attention.o_proj = _linear(attention.o_proj.weight.data[:, q_rows], _bias(attention.o_proj, compensation, biased))


class BlockInfluence:
    """1 - mean cosine similarity between a layer's input and output hidden states, over all
    tokens added: how much the layer turns the residual stream."""

    def __init__(self):
        self.total, self.count = 0.0, 0

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        cos = torch.nn.functional.cosine_similarity(x.float(), y.float(), dim=-1)
        self.total, self.count = self.total + cos.sum().item(), self.count + cos.numel()

    def hook(self, module, args, kwargs, output) -> None:
        """As a decoder layer's forward hook (registered `with_kwargs=True`): adds each call."""
        self.add(args[0] if args else kwargs["hidden_states"], output[0] if isinstance(output, tuple) else output)

    @property
    def value(self) -> float:
        return 1 - self.total / self.count


class LayerSubset:
    """`keep_layers`, undoable: run one loaded model on many subsets of its decoder layers
    (the latency table's measurements), each renumbered with its attention kinds cut to
    match, and put the whole model back."""

    def __init__(self, model: nn.Module):
        from pipelines.models import LAYER_WIDTHS, decoder_layers

        self.model, self.layers = model, decoder_layers(model)
        self.indices = [layer.self_attn.layer_idx for layer in self.layers]
        self.settings = {key: getattr(model.config, key) for key in ("num_hidden_layers", "layer_types", LAYER_WIDTHS) if hasattr(model.config, key)}

    def keep(self, kept: list[int]) -> None:
        self.restore()
        keep_layers(self.model, kept)

    def restore(self) -> None:
        from pipelines.models import architecture_of

        owner, name = architecture_of(self.model.config).layers.rsplit(".", 1)
        setattr(self.model.get_submodule(owner), name, self.layers)
        for layer, index in zip(self.layers, self.indices):
            layer.self_attn.layer_idx = index
        for key, value in self.settings.items():
            setattr(self.model.config, key, value)


def keep_layers(model: nn.Module, kept: list[int]) -> None:
    """Keep only the decoder layers `kept` (ascending indices), renumbered, with the config's
    per-layer lists (attention kinds, lmpress's layer widths) cut to match."""
    from pipelines.models import LAYER_WIDTHS, architecture_of, decoder_layers

    layers = decoder_layers(model)
    for new_index, old_index in enumerate(kept):
        layers[old_index].self_attn.layer_idx = new_index  # the KV cache is indexed by it
    owner, name = architecture_of(model.config).layers.rsplit(".", 1)
    setattr(model.get_submodule(owner), name, nn.ModuleList([layers[i] for i in kept]))
    model.config.num_hidden_layers = len(kept)
    for key in ("layer_types", LAYER_WIDTHS):  # per-layer attention kinds (sliding / full), widths
        if getattr(model.config, key, None):
            setattr(model.config, key, [getattr(model.config, key)[i] for i in kept])
