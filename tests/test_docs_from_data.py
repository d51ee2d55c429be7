"""The lists a newcomer reads are the data's: the README's toys, recipes, schemes and model families, and the
`--help` lists of `quant quantize` and `quant toy`, each checked against manifests/*.yaml and the scheme table (a
family, recipe or toy added to the data without the README fails here)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def _command_block_toys() -> list[str]:
    block = README[README.index("quant toy NAME OUT"):README.index("quant quantize SRC OUT")]
    text = " ".join(line.strip() for line in block.splitlines())
    return [t.strip() for t in text.split(":", 1)[1].split(",")]


def test_the_readme_command_block_lists_every_toy():
    from quant.toy import TOY_NAMES

    assert sorted(_command_block_toys()) == sorted(TOY_NAMES)


def test_the_readme_lists_every_recipe_and_scheme():
    from quant.planning.recipes import recipe_names
    from quant.planning.schemes import SCHEMES

    recipes = README[README.index("- Recipes (`--recipe`"):]
    recipes = recipes[:recipes.index("\n- ")]
    assert [n for n in recipe_names() if f"`{n}`" not in recipes] == []
    schemes = README[README.index("- Schemes (`--scheme`"):]
    schemes = schemes[:schemes.index("\n- ")]
    assert [n for n in SCHEMES if f"`{n}`" not in schemes] == []


def test_the_help_lists_come_from_the_data():
    from quant.commands.quantize import RECIPES_HELP, SCHEMES_HELP
    from quant.planning.recipes import recipe_names
    from quant.planning.schemes import SCHEMES

    assert all(n in RECIPES_HELP.split(" | ")[0] + " | " + RECIPES_HELP for n in recipe_names())
    assert SCHEMES_HELP.split(" | ") == list(SCHEMES)


def test_every_family_has_a_row_in_the_family_table_and_a_name_in_the_intro():
    from quant.families import families_dir

    table = README[README.index("| family (`model_type`)"):]
    table = table[:table.index("\n\n")]
    rows = {m for line in table.splitlines()[2:] for m in re.findall(r"\(`([a-z0-9_]+)`\)", line.split("|")[1])}
    intro = README[:README.index("## Quick start")]
    missing_rows, missing_intro = [], []
    for path in sorted(families_dir().glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        if path.stem == "generic":
            continue
        types = set(data.get("model_types") or [path.stem])
        if not types & rows:
            missing_rows.append(path.stem)
        if not any(f"`{t}`" in intro for t in types):
            missing_intro.append(path.stem)
    assert missing_rows == [] and missing_intro == []
