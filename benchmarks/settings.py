"""The decoding settings the benchmarks name, each one whole: every field of `settings_refusion.DECODING_FIELDS`.

A named setting is fixed where it is defined (`setting(base, **changes)`), so a row of a benchmark means the same
thing whatever the shipped model's defaults are; only `shipped()` follows the recipe config's `decoding` section,
as its name says. A benchmark decodes a setting through `generation_config(model, setting)`, which leaves none of
the model's own decoding defaults to show through.
"""

import copy

from transformers import GenerationConfig, PreTrainedModel

from recipe.model import shipped_decoding
from settings_refusion import DECODING_DEFAULTS, DECODING_FIELDS


def setting(base: dict, **changes) -> dict:
    """`base` (a whole setting) with `changes`, in `DECODING_FIELDS` order; refuses a field that is not a decoding
    setting and a result that leaves one out."""
    unknown = sorted((set(base) | set(changes)) - set(DECODING_FIELDS))
    if unknown:
        raise ValueError(f"not decoding settings: {unknown}; the settings are {list(DECODING_FIELDS)}")
    whole = {**base, **changes}
    missing = [name for name in DECODING_FIELDS if name not in whole]
    if missing:
        raise ValueError(f"a benchmark setting states every decoding field; missing: {missing}")
    return {name: whole[name] for name in DECODING_FIELDS}


# The fast rule with whole-slot checks and no fused redraft, at the shipped slot size, block and thresholds: the
# centre the benchmarks' rows change one thing of (their names say what).
WHOLE_SLOTS = setting(
    {},
    slot_size=16,
    slot_threshold=0.8,
    token_threshold=0.3,
    block_length=32,
    infill_mode="fast",
    fused_redraft=False,
    draft_window=None,
    draft_schedule="fixed",
    draft_prior=0.5,
    lookup_drafts=0,
)


def shipped() -> dict:
    """The shipped model's decoding setting, whole: the `decoding` section of the recipe config
    (`recipe/smollm2.yaml`), any field it leaves out at its `DECODING_DEFAULTS` value."""
    return setting(DECODING_DEFAULTS, **shipped_decoding())


def generation_config(model: PreTrainedModel, decoding: dict) -> GenerationConfig:
    """`model`'s generation config with every decoding field set from `decoding` (a whole setting). Given to
    `generate()` as `generation_config`, the setting applies as stated: none of the model's own decoding defaults
    (e.g. the shipped `draft_window`) shows through a field the setting leaves at None."""
    config = copy.deepcopy(model.generation_config)
    for name in DECODING_FIELDS:
        setattr(config, name, decoding[name])
    return config
