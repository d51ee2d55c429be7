"""What a source format is: one stored encoding of a weight, as one object that owns everything the tool does with
it (the shape of vLLM's Quark schemes, vllm/model_executor/layers/quantization/quark/schemes: one class per scheme,
the same methods on each):

- `recognise`: the Encoding of a stored weight, from the safetensors headers alone;
- `decode`: its exact fp32 values;
- `encode`: a weight written as the release stores it (toys and tests);
- `passes_through` / `carry`: whether a target scheme keeps its bytes, and those bytes in the target's spelling
  (a weight already in 4 bits is never rounded again);
- `loss`: what requantizing it to the target loses, beyond the error every requantized weight records.

Its data (tensor names, dtypes, the blocks its scale covers) is a row of quant/manifests/source_formats.yaml
`encodings`, read by quant.sources.registry; its behaviour is a subclass in a module of its own under
quant/sources/."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from quant.errors import QuantError

if TYPE_CHECKING:
    import torch

MICROSCALED = "microscaled"  # a checkpoint format recognised per weight, from its scale sibling alone
PER_TENSOR, PER_CHANNEL = (0, 0), (1, 0)  # FP8 scale "blocks": the whole tensor, one row
# How firmly a format's tensor names claim a weight/scale pair: by the `names` alone (a pair of other dtypes is
# refused), only a `scale` of its dtypes (an F32 weight_scale_inv is block FP8's), or only a `pair` of its dtypes
# (a BF16 weight beside a stray weight_scale is a plain weight, the stray tensor judged elsewhere).
CLAIMS = ("names", "scale", "pair")


class TensorHeader(Protocol):
    """What the headers say of one stored tensor."""

    @property
    def dtype(self) -> str: ...

    @property
    def shape(self) -> Sequence[int]: ...


Headers = Mapping[str, TensorHeader]


@dataclass(frozen=True)
class Encoding:
    """How one stored weight encodes its values: `kind` (its format's name), its scale tensor, the block the scale
    covers ([1, 32] for MX, [b, b] for block FP8, [1, 16] for NVFP4), the logical (decoded) shape, the module it is
    the weight of (`X` of `X.weight` / `X.weight_packed`) and, for NVFP4, its global-scale tensor."""

    kind: str
    scale: str
    block: tuple[int, int]
    shape: tuple[int, ...]
    module: str = ""
    global_scale: str = ""


def expected_scale_shapes(block: tuple[int, int], logical: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """The scale shapes a weight of decoded shape `logical` may have under `block` (none: the input dim is not a
    whole number of per-row groups)."""
    rows, k = logical[-2], logical[-1]
    if block == PER_TENSOR:
        return ((), (1,))
    if block == PER_CHANNEL:
        return ((rows,), (rows, 1))
    rb, cb = block
    if rb == 1 and k % cb:
        return ()
    return ((*logical[:-2], math.ceil(rows / rb), math.ceil(k / cb)),)


def block_label(block: tuple[int, int]) -> str:
    return {PER_TENSOR: "per-tensor", PER_CHANNEL: "per-channel"}.get(block, f"{block[0]}x{block[1]}")


@dataclass(frozen=True)
class SourceFormat:
    """One stored encoding: the weight tensor `X<weight>` and its scale `X<scale>` (dtypes, the blocks [rows,
    inputs] its scale may cover), whether codes are packed E2M1 pairs, for NVFP4 the per-tensor global scale, the
    tensors consumed with the weight without being needed to decode it, the checkpoint format a source holding it
    has (Plan.source_format) and how firmly its tensor names claim a pair (CLAIMS). Subclasses add behaviour only;
    the fields are the data file's row."""

    name: str
    release: str
    weight: str
    scale: str
    code_dtypes: tuple[str, ...]
    scale_dtypes: tuple[str, ...]
    blocks: tuple[tuple[int, int], ...]
    packed: bool = False
    global_scale: str = ""
    consumed: tuple[str, ...] = ()
    checkpoint: str = MICROSCALED
    claims: str = "names"

    def stores(self, weight_dtype: str, scale_dtype: str) -> bool:
        """Whether a weight and scale of these dtypes are this format's pair."""
        return weight_dtype in self.code_dtypes and scale_dtype in self.scale_dtypes

    def claims_pair(self, weight_dtype: str, scale_dtype: str) -> bool:
        """Whether a weight and scale with this format's names are this format's to judge (then refused when their
        dtypes fit no format of these names) or left to others (a plain weight, block FP8)."""
        if self.claims == "scale":
            return scale_dtype in self.scale_dtypes
        if self.claims == "pair":
            return self.stores(weight_dtype, scale_dtype)
        return True

    def pair_mismatch(self, weight: str, weight_dtype: str, scale: str, scale_dtype: str,
                      same_names: Sequence[SourceFormat]) -> str:
        """Why a pair this format claims, of dtypes no format with these names stores, is refused."""
        pairs = " or ".join(f"{'/'.join(f.code_dtypes)} codes with {'/'.join(f.scale_dtypes)} scales ({f.name})"
                            for f in same_names)
        return f"{weight} is {weight_dtype} with {scale} {scale_dtype}; expected {pairs}"

    def logical_shape(self, stored: Sequence[int]) -> tuple[int, ...]:
        """The decoded shape of a weight stored as `stored` (packed E2M1: two elements per byte)."""
        return (*stored[:-1], stored[-1] * 2) if self.packed else tuple(stored)

    def recognise(self, tensors: Headers, weight: str, where: str = "") -> Encoding | None:
        """The Encoding of `weight`, whose weight and scale dtypes are this format's (quant.sources.registry found
        the pair): its shape against the blocks the scale may cover, and the global scale NVFP4 needs. A shape that
        fits no block is refused, naming both tensors."""
        where = where or weight
        module = weight[: -len(self.weight)]
        scale = module + self.scale
        w, s = tensors[weight], tensors[scale]
        wshape, sshape = tuple(w.shape), tuple(s.shape)
        if module + ".weight_zero_point" in tensors:
            raise QuantError(f"{where}: {module}.weight_zero_point: asymmetric (zero-point) FP4 is not supported")
        logical = self.logical_shape(wshape)
        if len(wshape) < 2 or (not self.packed and len(wshape) != 2):
            raise QuantError(f"{where}: {weight} {w.dtype} {list(wshape)} with {scale} {list(sshape)}: a {self.name} "
                             f"weight must be {'at least ' if self.packed else ''}2-D")
        for block in self.blocks:
            if sshape in expected_scale_shapes(block, logical):
                return Encoding(self.name, scale, block, logical, module, self._global_scale(tensors, module, where))
        raise QuantError(f"{where}: {weight} {w.dtype} {list(wshape)} with {scale} {list(sshape)} "
                         f"{self.shape_mismatch(logical)}")

    def shape_mismatch(self, logical: tuple[int, ...]) -> str:
        """Why a scale of the wrong shape is refused (after `X.weight ... with X.scale ...`)."""
        wanted = " or ".join(str(list(e)) for b in self.blocks for e in expected_scale_shapes(b, logical))
        return (f"matches no {self.name} block size ({' or '.join(block_label(b) for b in self.blocks)}: scale "
                f"{wanted or 'none, the input dim is not a multiple of the group'})")

    def _global_scale(self, tensors: Headers, module: str, where: str) -> str:
        if not self.global_scale:
            return ""
        name = module + self.global_scale
        g = tensors.get(name)
        if g is None:
            raise QuantError(f"{where}: {module + self.weight} is NVFP4 but {name} is missing")
        if g.dtype != "F32" or math.prod(g.shape) != 1:
            raise QuantError(f"{where}: {name} is {g.dtype} {list(g.shape)}, expected one F32 value")
        return name

    def decode(self, encoding: Encoding, weight: torch.Tensor, scale: torch.Tensor, what: str = "",
               global_scale: torch.Tensor | None = None) -> torch.Tensor:
        """The exact fp32 values of a stored weight and its scale tensor (and NVFP4's global scale)."""
        raise NotImplementedError(f"{type(self).__name__}.decode")

    def encode(self, x: torch.Tensor, block: int = 128) -> dict[str, torch.Tensor]:
        """A 2-D weight written as the release stores it: {tensor-name suffix: tensor} under the release's scale
        rule (`block`: the square block of a block-scaled FP8 format)."""
        raise QuantError(f"no release encoder for source format {self.name!r}")

    def passes_through(self, encoding: Encoding, scheme_name: str | None) -> bool:
        """Whether a weight of this format headed for `scheme_name` keeps its codes and scales bit for bit."""
        return False

    def carry(self, codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int],
              scheme_name: str | None) -> dict[str, torch.Tensor]:
        """The target's parts of a weight that passes through: its bytes in the target's spelling, nothing
        decoded or rounded."""
        raise QuantError(f"a {self.name} weight has no target it passes through into")

    def loss(self, values: torch.Tensor, parts: dict[str, torch.Tensor], scheme_name: str) -> dict[str, int]:
        """What the manifest records of a requantized weight beyond its error figures (none by default)."""
        return {}
