"""What the plan does with one module: its role and the scheme it is written in (None: it stays BF16).

The rule needs the family, the recipe, the scheme and the MTP layout, not a checkpoint, so the planner
(`quant.planning.plan.Planner.treatment`) and `quant quantize --dry-run` (quant/gptq/dry_run.py, which has only
config.json) ask the same object.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from quant.families import KEEP, Family, MtpLayout
from quant.planning.recipes import BF16, SCHEME, SECONDARY, Recipe
from quant.planning.schemes import Scheme, secondary_scheme

LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_of(name: str) -> int | None:
    m = LAYER.search(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class ModuleTreatment:
    family: Family
    recipe: Recipe
    scheme: Scheme
    mtp: MtpLayout

    def __call__(self, module: str) -> tuple[str | None, Scheme | None]:
        """(role, scheme) for a module; scheme None = stays BF16."""
        # An MTP layer of the decoder stack: the recipe may keep it whole, the family keeps its glue (a namespaced
        # MTP head is kept by the family's roles)
        if layer_of(module) in self.mtp.decoder_layers and (self.recipe.mtp_layer == "bf16"
                                                            or self.mtp.keeps(module)):
            return "mtp_keep", None
        role = self.family.role_of(module)
        treatment = self.recipe.treatment(role, module)
        if treatment == SCHEME and self.family.kept_under(module, self.scheme.name):
            return role, None
        if treatment == SCHEME:
            return role, self.scheme
        if treatment in SECONDARY:
            return role, secondary_scheme(self.scheme, treatment)
        assert treatment == BF16
        return role, None

    def recipe_can_quantize(self, module: str) -> bool:
        """Whether some recipe could quantize `module`: a linear that plays a role (not kept by the family: embeddings,
        routers, the MTP glue). The denominator of an export's effective bits."""
        if layer_of(module) in self.mtp.decoder_layers and self.mtp.keeps(module):
            return False
        return self.family.role_of(module) not in (None, KEEP)
