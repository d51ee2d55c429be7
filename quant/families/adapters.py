"""Family adapters: the few things a family file cannot say as data, as small named functions.

A family file opts in with `adapter: NAME`. An adapter gets the config.json dict and returns the config the
family's data is evaluated against (shape formulas, MTP counts), e.g. a release that spells a key its own way.
Wrappers, prefixes, MTP placement, runtime names and release recipes are all data; the registry holds the few
spellings a formula cannot reach (a size nested in a sub-object of the release's config).
"""

from __future__ import annotations

from typing import Callable


def minimax_m3_sparse_attention(config: dict) -> dict:
    """MiniMax-M3's release sizes its lightning indexer in text_config.sparse_attention_config
    (sparse_num_index_heads, sparse_index_dim); the shape formulas use transformers' flat index_n_heads /
    index_head_dim, to which transformers maps them the same way (5.24 configuration_minimax_m3_vl.py,
    MiniMaxM3VLTextConfig.__post_init__). Keys the config already has win."""
    inner = config.get("text_config")
    text = inner if isinstance(inner, dict) else config
    sparse = text.get("sparse_attention_config")
    if not isinstance(sparse, dict):
        return config
    flat = {key: sparse[legacy] for key, legacy in (("index_n_heads", "sparse_num_index_heads"),
                                                    ("index_head_dim", "sparse_index_dim"))
            if legacy in sparse and key not in text}
    return {**config, "text_config": {**text, **flat}} if text is inner else {**config, **flat}


def minimax_m3_dspark(config: dict) -> dict:
    """MiniMax-M3.1 sizes its DSpark draft (the family's `dspark` sidecar file) in dspark_config.ffn_hidden_size and
    text_config.dflash_config.target_layer_ids; the shape formulas read them as SGLang 0.5.23's
    configure_minimax_m3_dspark resolves them: dspark_ffn_hidden_size (its fallback spelling, configs/minimax_vl.py
    :82-84) and dspark_target_layer_ids (:101, whose length sizes fc's input). Keys the config already has win."""
    inner = config.get("text_config")
    text = inner if isinstance(inner, dict) else config
    draft = config.get("dspark_config") or text.get("dspark_config")
    dflash = text.get("dflash_config")
    found = {"dspark_ffn_hidden_size": draft.get("ffn_hidden_size") if isinstance(draft, dict) else None,
             "dspark_target_layer_ids": dflash.get("target_layer_ids") if isinstance(dflash, dict) else None}
    flat = {k: v for k, v in found.items() if v is not None and k not in text and k not in config}
    if not flat:
        return config
    return {**config, "text_config": {**text, **flat}} if text is inner else {**config, **flat}


def minimax_m3(config: dict) -> dict:
    """MiniMax-M3's release spellings the formulas cannot reach: its indexer's sizes, then M3.1's DSpark draft's."""
    return minimax_m3_dspark(minimax_m3_sparse_attention(config))


def kimi_linear_attention(config: dict) -> dict:
    """Kimi-Linear / Kimi-K3 size their KDA layers in text_config.linear_attn_config (num_heads, head_dim,
    short_conv_kernel_size: SGLang 0.5.23 configs/kimi_linear.py, models/kimi_k3.py KimiK3DeltaAttention); the shape
    formulas read them as kda_num_heads, kda_head_dim, kda_short_conv_kernel_size. Keys the config already has win."""
    inner = config.get("text_config")
    text = inner if isinstance(inner, dict) else config
    kda = text.get("linear_attn_config")
    if not isinstance(kda, dict):
        return config
    flat = {f"kda_{key}": kda[key] for key in ("num_heads", "head_dim", "short_conv_kernel_size")
            if key in kda and f"kda_{key}" not in text}
    return {**config, "text_config": {**text, **flat}} if text is inner else {**config, **flat}


ADAPTERS: dict[str, Callable[[dict], dict]] = {"minimax_m3": minimax_m3,
                                                "minimax_m3_sparse_attention": minimax_m3_sparse_attention,
                                                "kimi_linear_attention": kimi_linear_attention}
