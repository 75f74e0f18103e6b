"""Per-layer activation statistics and the calibration artifact that stores them.

For every linear input the collector keeps the second moment E[x x^T] (the Hessian GPTQ and
SparseGPT need, up to a factor), the mean (with the diagonal: Wanda's input norms and FLAP's
fluctuation), the mean magnitude E|x| (AWQ's activation scale), and the token count. Linears that read the same tensor (q/k/v, gate/up) share
one entry: the grouping is found by identity of the input tensor, so no per-family table is
needed. It also keeps, per layer, the token-averaged cosine similarity between every pair of
KV heads' key and value outputs (not derivable from the moments): how alike the base model's
heads are. (`lmpress kv-merge` measures it again layer by layer on the model as merged so far,
with the same HeadSimilarity.)

The calibration artifact:
    manifest.json                 settings, sample ids, data hash, linear -> group map
    samples.safetensors           input_ids [samples, seq_len]
    stats/layer_NNN.safetensors   `<group>.second_moment`, `.mean`, `.abs_mean`, `kv.k_cosine`, ...
    lineage.json
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from pipelines.artifact import read_json, read_lineage, read_safetensors, require_keys
from pipelines.errors import require, require_input
from pipelines.models import head_dim_of

CALIBRATION_FORMAT = "lmpress-calibration/1"
BLOCK_INFLUENCE = "block.influence"  # 1 - mean cos(layer input, layer output) over all tokens


class Moments:
    """Running sums over a linear's input tokens, in fp64: x^T x (its lower triangle), x, |x|.

    On the CPU a batch's x^T x is summed in fp32 by BLAS syrk, straight into a buffer kept
    between batches, and added onto the fp64 sum once per batch. syrk computes one triangle:
    half the multiply-adds of x.T @ x (torch has no syrk call). This runs in a sequential
    stage's collecting pass, its memory peak and, after the layer's own matmuls, its largest
    cost; so the tokens are converted to fp32 1024 at a time into a kept buffer too, and no
    per-chunk product is allocated: no fragmenting heap, few fp64 additions."""

    CHUNK = 1024  # tokens converted to fp32 at a time

    def __init__(self, features: int):
        self.count = 0
        self.xtx_lower = torch.zeros(features, features, dtype=torch.float64)
        self.sum = torch.zeros(features, dtype=torch.float64)
        self.abs_sum = torch.zeros(features, dtype=torch.float64)
        self._tokens: torch.Tensor | None = None  # fp32 [CHUNK, features] scratch
        self._batch_gram: np.ndarray | None = None  # fp32, Fortran order: syrk's in-place output

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1])
        if x.device.type != "cpu":
            for chunk in x.split(self.CHUNK):
                chunk = chunk.float()
                self.xtx_lower += torch.tril(chunk.T @ chunk).cpu()
                self.sum += chunk.sum(0).cpu()
                self.abs_sum += chunk.abs().sum(0).cpu()
            self.count += x.shape[0]
            return
        from scipy.linalg.blas import ssyrk

        features = x.shape[-1]
        if self._tokens is None:
            self._tokens = torch.empty(self.CHUNK, features)
            self._batch_gram = np.zeros((features, features), dtype=np.float32, order="F")  # never-written half stays 0
        for i, chunk in enumerate(x.split(self.CHUNK)):
            tokens = self._tokens[: chunk.shape[0]]
            tokens.copy_(chunk)
            # tokens.T is Fortran-ordered (no copy); the Fortran upper triangle syrk writes
            # (beta 0 on a batch's first chunk: overwritten, not read) is a C-ordered lower one
            ssyrk(1.0, tokens.numpy().T, beta=float(i > 0), c=self._batch_gram, overwrite_c=1)
            self.sum += tokens.sum(0)
            self.abs_sum += tokens.abs_().sum(0)
        # numpy casts fp32 -> fp64 in small buffers; torch's mixed-dtype += would allocate an fp64 copy
        np.add(self.xtx_lower.numpy(), self._batch_gram.T, out=self.xtx_lower.numpy())
        self.count += x.shape[0]

    def second_moment(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """E[x x^T], divided in fp64 and rounded to `dtype`. One temporary of `dtype`: the plain
        fp64 expression holds three [in, in] fp64 temporaries (57 MB for a 1536-wide input) at
        every layer's end of a sequential stage, and where they land the heap stays fragmented."""
        moment = torch.empty(self.xtx_lower.shape, dtype=dtype)
        np.divide(self.xtx_lower.numpy(), self.count, out=moment.numpy(), casting="unsafe")  # the upper half: 0
        return moment.add_(moment.tril(-1).T)

    def statistics(self) -> "LinearStatistics":
        """What a compressor reads (fp32) of the input these moments summed."""
        return LinearStatistics(self.second_moment(torch.float32), (self.sum / self.count).float(), (self.abs_sum / self.count).float(), self.count)


class HeadSimilarity:
    """Token-averaged cosine similarity between heads of a k/v projection output."""

    def __init__(self, heads: int, head_dim: int):
        self.heads, self.head_dim, self.count = heads, head_dim, 0
        self.total = torch.zeros(heads, heads, dtype=torch.float64)

    def add(self, y: torch.Tensor) -> None:
        y = torch.nn.functional.normalize(y.reshape(-1, self.heads, self.head_dim).float(), dim=-1)
        self.total += torch.einsum("thd,tgd->hg", y, y).cpu().double()
        self.count += y.shape[0]


class LayerStatisticsCollector:
    """Hooks on one decoder layer's linears while `runner.forward(layer)` runs. The moments are
    taken as each linear is called, before it runs, so a pass that only collects can stop at
    the layer's last linear (`runner.forward(layer, propagate=False, until=...)`)."""

    def __init__(self, linears: dict[str, nn.Linear], config):
        self.linears = linears
        self.group: dict[str, str] = {}  # linear -> first linear reading the same tensor
        self._first_inputs: list[tuple[str, torch.Tensor]] = []
        self.moments: dict[str, Moments] = {}
        heads, head_dim = config.num_key_value_heads, head_dim_of(config)
        self.similarity = {"k": HeadSimilarity(heads, head_dim), "v": HeadSimilarity(heads, head_dim)}
        self._handles = []

    def _input_hook(self, name: str):
        def hook(module, args):
            x = args[0]
            if name not in self.group:
                leader = next((other for other, seen in self._first_inputs if seen is x), name)
                self.group[name] = leader
                self._first_inputs.append((name, x))
                if leader == name:
                    self.moments[name] = Moments(x.shape[-1])
                if len(self.group) == len(self.linears):
                    self._first_inputs.clear()  # drop the references to the first batch
            if self.group[name] == name:
                self.moments[name].add(x)

        return hook

    def _head_hook(self, kind: str):
        return lambda module, args, output: self.similarity[kind].add(output)

    def __enter__(self):
        self._handles = [module.register_forward_pre_hook(self._input_hook(name)) for name, module in self.linears.items()]
        self._handles += [
            module.register_forward_hook(self._head_hook(name[-6])) for name, module in self.linears.items() if name.endswith(("k_proj", "v_proj"))
        ]
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, m in self.moments.items():
            stats = m.statistics()
            out.update({f"{name}.second_moment": stats.second_moment, f"{name}.mean": stats.mean, f"{name}.abs_mean": stats.abs_mean})
        for kind, s in self.similarity.items():
            if s.count:  # a collector on a subset of the linears may see no k/v outputs
                out[f"kv.{kind}_cosine"] = (s.total / s.count).float().contiguous()
        return out

    @property
    def tokens(self) -> int:
        return next(iter(self.moments.values())).count

    def statistics(self) -> dict[str, "LinearStatistics"]:
        """linear path in the layer -> its input statistics (as CalibrationData.layer gives)."""
        shared = {g: moments.statistics() for g, moments in self.moments.items()}
        return {linear: shared[g] for linear, g in self.group.items()}


@dataclass
class LinearStatistics:
    """What a compressor reads about one linear's input."""

    second_moment: torch.Tensor  # E[x x^T], [in, in]
    mean: torch.Tensor  # E[x], [in]
    abs_mean: torch.Tensor  # E|x|, [in] (AWQ's activation magnitude)
    tokens: int

    @property
    def xtx(self) -> torch.Tensor:
        return self.second_moment * self.tokens

    @property
    def channel_norm(self) -> torch.Tensor:
        """||X_j||_2 over all calibration tokens (Wanda's activation norm)."""
        return (self.second_moment.diagonal() * self.tokens).clamp_min(0).sqrt()

    @property
    def channel_variance(self) -> torch.Tensor:
        """Var[x_j] over tokens (FLAP's fluctuation)."""
        return (self.second_moment.diagonal() - self.mean**2).clamp_min(0)


RECALIBRATE = "re-run `lmpress calibrate`"
MANIFEST_KEYS = ("seed", "seq_len", "corpus", "data_sha256", "sample_ids", "documents", "tokens", "groups")  # what readers use


def spread_indices(count: int, stored: int, skip: list[int] | tuple = ()) -> list[int]:
    """`count` indices evenly spaced over `stored` calibration windows, leaving out `skip` (the
    windows are grouped by corpus part, so the first few would all come from one part); all
    that are left when count is larger."""
    free = [i for i in range(stored) if i not in set(skip)]
    if count >= len(free):
        return free
    return [free[i] for i in torch.linspace(0, len(free) - 1, count).round().long().tolist()]


class CalibrationData:
    """Read side of the calibration artifact; loads one layer's statistics at a time."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        require_input(self.folder, True, "calibration artifact", "pass the folder `lmpress calibrate` wrote")
        self.manifest = read_json(self.folder / "manifest.json", "re-run `lmpress calibrate`") if (self.folder / "manifest.json").is_file() else {}
        require(
            self.manifest.get("format") == CALIBRATION_FORMAT,
            f"{self.folder} is not an lmpress calibration artifact; run `lmpress calibrate`",
        )
        require_keys(self.manifest, MANIFEST_KEYS, self.folder / "manifest.json", RECALIBRATE)
        self.lineage = read_lineage(self.folder)

    @property
    def input_ids(self) -> torch.Tensor:
        return read_safetensors(self.folder / "samples.safetensors", RECALIBRATE)["input_ids"]

    def spread_samples(self, count: int) -> torch.Tensor:
        """`count` windows evenly spaced over the stored ones (spread_indices)."""
        ids = self.input_ids
        return ids[spread_indices(count, ids.shape[0])]

    def check_model(self, base_weights_sha256: str) -> None:
        require(self.lineage is not None, f"{self.folder} has no lineage.json (it records the model calibrated); re-run `lmpress calibrate`")
        calibrated = self.lineage["chain"][0].get("weights_sha256")
        require(
            calibrated == base_weights_sha256,
            f"calibration {self.folder} was made for another base model; re-run `lmpress calibrate` for this model",
        )

    def layer(self, index: int) -> dict[str, LinearStatistics]:
        """linear path inside the layer -> its input statistics."""
        tensors = read_safetensors(self.folder / "stats" / f"layer_{index:03d}.safetensors", RECALIBRATE)
        tokens = self.manifest["tokens"]
        require(
            all(f"{group}.abs_mean" in tensors for group in self.manifest["groups"].values()),
            f"{self.folder} predates the E|x| statistics; re-run `lmpress calibrate`",
        )
        return {
            linear: LinearStatistics(tensors[f"{group}.second_moment"], tensors[f"{group}.mean"], tensors[f"{group}.abs_mean"], tokens)
            for linear, group in self.manifest["groups"].items()
        }

    def block_influence(self) -> list[float]:
        """Per decoder layer, 1 - mean cos(input, output) over the calibration tokens."""
        values = []
        for file in sorted((self.folder / "stats").glob("layer_*.safetensors")):
            tensors = read_safetensors(file, RECALIBRATE)
            require(BLOCK_INFLUENCE in tensors, f"{self.folder} predates the block influence statistic; re-run `lmpress calibrate`")
            values.append(float(tensors[BLOCK_INFLUENCE]))
        return values

    def head_similarity(self, index: int) -> dict[str, torch.Tensor]:
        tensors = read_safetensors(self.folder / "stats" / f"layer_{index:03d}.safetensors", RECALIBRATE)
        return {"k": tensors["kv.k_cosine"], "v": tensors["kv.v_cosine"]}
