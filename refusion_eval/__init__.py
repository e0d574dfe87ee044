"""lm-evaluation-harness support: the `refusion` model.

    python -m refusion_eval --model refusion --model_args pretrained=FOLDER,slot_size=8 --tasks gsm8k

`python -m refusion_eval` (or the `refusion-lm-eval` command) is lm-eval's own command line with the `refusion`
model registered; lm-eval has no plugin hook for models, so plain `lm_eval` does not see it. From Python, importing
this package registers it for `lm_eval.simple_evaluate(model="refusion", ...)`.

Generation tasks (`generate_until`) decode with ReFusion; loglikelihood tasks score with the model's ordinary
left-to-right forward, which conversion leaves equal to the base model's.
"""

from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from settings_refusion import DECODING_FIELDS, SETTING, check_decoding


@register_model("refusion")
class RefusionLM(HFLM):
    """`HFLM` whose generation uses ReFusion plan-and-infill decoding with the decoding parameters given in
    `model_args` (any of `settings_refusion.DECODING_SETTINGS`, e.g. `infill_mode=reference,draft_window=none`);
    the others come from the model's generation config."""

    def __init__(self, pretrained, **kwargs):
        given = {name: kwargs.pop(name) for name in DECODING_FIELDS if name in kwargs}
        self.decoding = {name: SETTING[name].parse(str(value)) for name, value in given.items()}
        check_decoding(self.decoding)  # refuse conflicting arguments before loading anything
        kwargs.setdefault("trust_remote_code", True)
        super().__init__(pretrained=pretrained, **kwargs)

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs):
        """Decode with ReFusion; stop sequences act on each answer's in-order prefix."""
        generation_kwargs.setdefault("do_sample", False)
        if not generation_kwargs["do_sample"]:
            generation_kwargs.pop("temperature", None)
        return self.model.generate(
            input_ids=context,
            max_length=max_length,
            stop_strings=[text for text in stop if text] or None,
            tokenizer=self.tokenizer,
            pad_token_id=self.tokenizer.pad_token_id,
            **{**generation_kwargs, **self.decoding},
        )


__all__ = ["RefusionLM"]
