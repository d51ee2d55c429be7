"""The conventions users bring from the peers (issue #50 item 6): their scheme names accepted where they mean the same
scheme and refused, saying what to write, where they do not; SRC OUT usage and plain metavars in --help, whole at any
width; one meaning per flag name; a did-you-mean for a mistyped value."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from quant.errors import QuantError, did_you_mean
from quant.planning.schemes import ALIASES, SCHEMES, scheme_name


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_a_peers_name_for_a_scheme_is_that_scheme(alias):
    assert scheme_name(alias) == ALIASES[alias][0] and ALIASES[alias][0] in SCHEMES


@pytest.mark.parametrize("name,says", [("FP8", "--scheme fp8"), ("w_fp8_a_fp8", "ptpc_fp8"), ("NVFP4", "source"),
                                       ("MXFP8A16", "w_mxfp8_a_mxfp8")])
def test_a_peers_name_for_another_scheme_is_refused_with_what_to_write(name, says):
    with pytest.raises(QuantError) as caught:
        scheme_name(name)
    assert caught.value.exit_code == 2 and says in str(caught.value)


def test_ours_win_over_a_peers_spelling():
    assert scheme_name("fp8") == "fp8" and scheme_name("mxfp8") == "w_mxfp8_a_mxfp8"  # llm-compressor's MXFP8


def test_did_you_mean():
    assert did_you_mean("w_mxfp4_a_mxfp44", SCHEMES) == " (did you mean 'w_mxfp4_a_mxfp4'?)"
    assert did_you_mean("all-linaer", ["experts-only", "all-linear"]) == " (did you mean 'all-linear'?)"
    assert did_you_mean("zzz", SCHEMES) == ""


def _help(*args, columns=60):
    env = {**os.environ, "COLUMNS": str(columns), "QUANT_NO_SUPERVISOR": "1"}
    run = subprocess.run([sys.executable, "-m", "quant", *args, "--help"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stdout


@pytest.mark.parametrize("command,usage", [(["quantize"], "Usage: quant quantize [OPTIONS] SRC OUT"),
                                           (["toy"], "Usage: quant toy [OPTIONS] NAME OUT"),
                                           (["push"], "Usage: quant push [OPTIONS] EXPORT REPO")])
def test_help_reads_as_the_readme_writes_it(command, usage):
    text = _help(*command)
    assert usage in text and "<str>" not in text and "<bool>" not in text and "{" + command[0] not in text
    assert "…" not in text  # nothing cut at 60 columns
    if command == ["quantize"]:
        assert "Salesforce/wikitext:wikitext-2-raw-v1:train" in text.replace("\n", "").replace(" ", "")
        assert "MXFP4 = w_mxfp4_a_mxfp4 (LLM Compressor)" in " ".join(text.split())


def test_force_means_one_thing():
    """`toy --force` meant overwrite, `push --force` push despite errors: toy's is --overwrite only."""
    assert "--force" not in _help("toy") and "--overwrite" in _help("toy")
    assert "--force" in _help("push")
