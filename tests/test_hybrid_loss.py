"""The ReFusion hybrid loss on `build_hybrid_batch` batches, against a slow reference from its definition."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from tiny import tiny_backbone

from configuration_refusion import RefusionConfig
from finetune.hybrid import IGNORE_INDEX, HybridObjectiveCollator, build_hybrid_batch
from finetune.trainer import converted_model_log_probs
from modeling_refusion import RefusionForCausalLM, refusion_hybrid_loss, refusion_soft_target_loss

VOCAB = 128
MASK = VOCAB - 1
PAD = 0
BACKBONES = ("llama", "qwen3")


def tiny_refusion(architecture: str) -> RefusionForCausalLM:
    """A 2-layer random ReFusion model over a tiny backbone, in float64."""
    text_config = tiny_backbone(architecture, vocab_size=VOCAB).config
    torch.manual_seed(0)
    return RefusionForCausalLM(RefusionConfig(text_config=text_config.to_dict(), mask_token_id=MASK)).double()


def examples(seed: int, count: int = 4) -> tuple[list[list[int]], list[list[int]]]:
    """Random prompt/response pairs of different lengths."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 30, (count, 2), generator=generator).tolist()
    prompts = [torch.randint(MASK, (p,), generator=generator).tolist() for p, _ in lengths]
    responses = [torch.randint(MASK, (r,), generator=generator).tolist() for _, r in lengths]
    return prompts, responses


def hybrid_batch(prompts, responses, seed: int, slot_sizes=(2, 4, 8)) -> dict[str, torch.Tensor]:
    """A hybrid batch without the logging-only `slot_size`."""
    generator = torch.Generator().manual_seed(seed)
    batch = build_hybrid_batch(
        prompts, responses, mask_token_id=MASK, pad_token_id=PAD, slot_sizes=slot_sizes, generator=generator
    )
    batch.pop("slot_size")
    return batch


def mixed_batch() -> dict[str, torch.Tensor]:
    """The first seeded batch that has both clean-slot (AR) labels and masked (MDM) positions."""
    for seed in range(100):
        batch = hybrid_batch(*examples(seed), seed=seed)
        has_ar = ((batch["labels"] != IGNORE_INDEX) & ~batch["is_masked"]).any()
        if batch["is_masked"].any() and has_ar:
            return batch
    raise AssertionError("no seed gave a batch with both AR and MDM labels")


def slow_reference(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(AR, MDM) losses computed token by token from the definition in the notes, in float64."""
    log_probs = logits.double().log_softmax(-1)
    ar_terms, mdm_per_example = [], []
    for b in range(logits.shape[0]):
        p = float(batch["noise_level"][b])
        response_length = int(batch["response_length"][b])
        mdm_sum = 0.0
        for i in range(logits.shape[1]):
            label = int(batch["labels"][b, i])
            if label == IGNORE_INDEX:
                continue
            cross_entropy = -float(log_probs[b, i, label])
            if batch["is_masked"][b, i]:
                mdm_sum += cross_entropy
            else:
                ar_terms.append(cross_entropy)
        mdm_per_example.append(mdm_sum / (p * response_length))
    ar = sum(ar_terms) / len(ar_terms) if ar_terms else 0.0
    return ar, sum(mdm_per_example) / len(mdm_per_example)


@pytest.mark.parametrize("architecture", sorted(BACKBONES))
def test_loss_matches_slow_reference(architecture):
    model = tiny_refusion(architecture)
    batch = mixed_batch()
    out = model(**batch)
    ar, mdm = slow_reference(out.logits.detach(), batch)
    assert torch.isfinite(out.loss)
    # The loss computes its cross-entropy in float32 (see `refusion_hybrid_loss`), hence the relative tolerance.
    assert out.ar_loss.item() == pytest.approx(ar, rel=1e-6, abs=1e-6)
    assert out.mdm_loss.item() == pytest.approx(mdm, rel=1e-6, abs=1e-6)
    torch.testing.assert_close(out.loss, out.ar_loss + out.mdm_loss, rtol=0, atol=0)
    assert out.loss.item() == pytest.approx(ar + mdm, rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("architecture", sorted(BACKBONES))
def test_loss_backpropagates_to_every_layer(architecture):
    model = tiny_refusion(architecture)
    model(**mixed_batch()).loss.backward()
    grads = {"embeddings": model.model.embed_tokens.weight.grad, "lm_head": model.lm_head.weight.grad}
    for index, layer in enumerate(model.model.layers):
        grads[f"layer {index} q_proj"] = layer.self_attn.q_proj.weight.grad
        grads[f"layer {index} down_proj"] = layer.mlp.down_proj.weight.grad
    for name, grad in grads.items():
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name


@pytest.mark.parametrize("architecture", sorted(BACKBONES))
def test_padding_does_not_change_a_row(architecture):
    """Out-of-order position ids plus right padding: each row's logits equal those of the row run alone."""
    model = tiny_refusion(architecture)
    batch = mixed_batch()
    logits = model(**batch).logits
    for b in range(logits.shape[0]):
        real = int(batch["attention_mask"][b].sum())
        alone = model(
            input_ids=batch["input_ids"][b : b + 1, :real], position_ids=batch["position_ids"][b : b + 1, :real]
        )
        torch.testing.assert_close(logits[b, :real], alone.logits[0], rtol=1e-9, atol=1e-9)


def test_perfect_predictor_has_zero_loss():
    batch = mixed_batch()
    one_hot = F.one_hot(batch["labels"].clamp(min=0), VOCAB).double()
    logits = 100.0 * one_hot * (batch["labels"] != IGNORE_INDEX)[..., None]
    loss, ar, mdm = refusion_hybrid_loss(
        logits, batch["labels"], batch["is_masked"], batch["noise_level"], batch["response_length"]
    )
    assert loss.item() < 1e-4 and ar.item() < 1e-4 and mdm.item() < 1e-4
    uniform = torch.zeros_like(logits)
    loss, _, _ = refusion_hybrid_loss(
        uniform, batch["labels"], batch["is_masked"], batch["noise_level"], batch["response_length"]
    )
    assert loss.item() > math.log(VOCAB)  # AR alone is log(V); the MDM part adds more


def test_the_mdm_term_is_weighted_by_the_configs_mdm_loss_weight():
    batch = mixed_batch()
    logits = torch.randn(*batch["labels"].shape, VOCAB, generator=torch.Generator().manual_seed(0)).double()
    fields = (batch["labels"], batch["is_masked"], batch["noise_level"], batch["response_length"])
    loss, ar, mdm = refusion_hybrid_loss(logits, *fields)
    weighted, ar_again, mdm_again = refusion_hybrid_loss(logits, *fields, mdm_weight=3.0)
    assert torch.equal(ar, ar_again) and torch.equal(mdm, mdm_again)  # the parts are logged unweighted
    torch.testing.assert_close(weighted, ar + 3.0 * mdm)
    torch.testing.assert_close(loss, ar + mdm)


@pytest.mark.parametrize("missing", ["is_masked", "noise_level", "response_length"])
def test_forward_with_labels_needs_the_hybrid_fields(missing):
    model = tiny_refusion("llama")
    batch = mixed_batch()
    del batch[missing]
    with pytest.raises(ValueError, match="is_masked"):
        model(**batch)


def single_slot_example(masked: bool) -> dict[str, torch.Tensor]:
    """A one-example batch whose response is a single slot, either masked or clean."""
    for seed in range(200):
        batch = hybrid_batch([[5, 6, 7]], [[10, 11, 12, 13, 14]], seed=seed, slot_sizes=(8,))
        if bool(batch["is_masked"].any()) == masked:
            return batch
    raise AssertionError("no seed gave the wanted masking")


@pytest.mark.parametrize("case", ["nothing masked", "everything masked", "both in one batch"])
def test_extreme_masking_gives_finite_loss(case):
    model = tiny_refusion("qwen3")
    clean, masked = single_slot_example(masked=False), single_slot_example(masked=True)
    if case == "nothing masked":
        batch = clean
    elif case == "everything masked":
        batch = masked
    else:
        batch = {key: torch.cat([clean[key], masked[key]]) for key in clean}
    out = model(**batch)
    ar, mdm = slow_reference(out.logits.detach(), batch)
    assert torch.isfinite(out.loss) and torch.isfinite(out.ar_loss) and torch.isfinite(out.mdm_loss)
    assert out.ar_loss.item() == pytest.approx(ar, rel=1e-6, abs=1e-6)
    assert out.mdm_loss.item() == pytest.approx(mdm, rel=1e-6, abs=1e-6)
    if case == "nothing masked":
        assert out.mdm_loss.item() == 0.0
    if case == "everything masked":
        assert out.ar_loss.item() == 0.0
    out.loss.backward()
    assert all(torch.isfinite(param.grad).all() for param in model.parameters() if param.grad is not None)


def test_collator_from_refusion_config_feeds_the_model():
    model = tiny_refusion("llama")
    collator = HybridObjectiveCollator.from_config(model.config, pad_token_id=PAD, seed=0)
    assert (collator.mask_token_id, collator.slot_sizes, collator.eps) == (MASK, (4, 8, 16, 32), 1e-3)
    prompts, responses = examples(seed=1)
    batch = collator([{"prompt_ids": p, "response_ids": r} for p, r in zip(prompts, responses)])
    assert torch.isfinite(model(**batch).loss)  # the logging-only `slot_size` key is accepted by forward


def suffix_batch(decay: float | None = 0.6) -> tuple[dict[str, torch.Tensor], list[list[int]], torch.Tensor]:
    """The first seeded suffix-masked batch with clean prefixes inside masked slots; its examples in reading order
    and where those prefix tokens sit."""
    for seed in range(100):
        prompts, responses = examples(seed)
        batches = [
            build_hybrid_batch(
                prompts,
                responses,
                mask_token_id=MASK,
                pad_token_id=PAD,
                slot_sizes=(4, 8),
                generator=torch.Generator().manual_seed(seed),
                slot_masking=masking,
                acceptance_decay=decay,
            )
            for masking in ("whole", "suffix")
        ]
        revealed = batches[0]["is_masked"] & ~batches[1]["is_masked"]
        if revealed.any() and batches[1]["is_masked"].any():
            batch = batches[1]
            batch.pop("slot_size")
            return batch, [p + r for p, r in zip(prompts, responses)], revealed
    raise AssertionError("no seed gave a clean prefix inside a masked slot")


@pytest.mark.parametrize("architecture", sorted(BACKBONES))
def test_a_clean_prefix_is_context_for_its_slots_masks_and_for_nothing_stored_before_it(architecture):
    model = tiny_refusion(architecture)
    batch, _, revealed = suffix_batch(decay=None)
    b, i = (int(index) for index in revealed.nonzero()[0])
    inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "position_ids")}
    changed = {**inputs, "input_ids": inputs["input_ids"].clone()}
    changed["input_ids"][b, i] = (changed["input_ids"][b, i] + 1) % MASK
    with torch.no_grad():
        differs = (model(**inputs).logits[b] - model(**changed).logits[b]).abs().amax(-1) > 1e-9
    assert not differs[:i].any(), "attention is causal in storage order: the prompt and clean slots never see it"
    position = batch["position_ids"][b]
    # The masks right after it in storage are its own slot's remaining tokens, at the next reading positions.
    masks_after = [j for j in range(i + 1, batch["input_ids"].shape[1]) if batch["is_masked"][b, j]]
    own_slot = [j for j in masks_after if int(position[j]) == int(position[i]) + 1 + masks_after.index(j)]
    assert own_slot and all(differs[j] for j in own_slot)


@pytest.mark.parametrize("architecture", sorted(BACKBONES))
def test_token_weights_multiply_each_masks_term_and_leave_the_ar_term(architecture):
    model = tiny_refusion(architecture)
    batch, _, _ = suffix_batch(decay=0.6)
    weight = batch.pop("mdm_token_weight")
    logits = model(**batch).logits.detach()
    fields = (batch["labels"], batch["is_masked"], batch["noise_level"], batch["response_length"])
    _, ar, mdm = refusion_hybrid_loss(logits, *fields, token_weight=weight)
    _, ar_plain, mdm_plain = refusion_hybrid_loss(logits, *fields)
    log_probs = logits.log_softmax(-1)
    per_example = []
    for b in range(logits.shape[0]):
        scale = float(batch["noise_level"][b]) * int(batch["response_length"][b])
        terms = [
            -float(log_probs[b, i, batch["labels"][b, i]]) * float(weight[b, i])
            for i in range(logits.shape[1])
            if batch["is_masked"][b, i]
        ]
        per_example.append(sum(terms) / scale)
    assert mdm.item() == pytest.approx(sum(per_example) / len(per_example), rel=1e-6)
    assert torch.equal(ar, ar_plain) and not torch.allclose(mdm, mdm_plain)


@pytest.mark.parametrize("architecture", sorted(BACKBONES))
def test_soft_target_loss_equals_a_hand_computation_against_the_model_without_its_adapter(architecture):
    model = tiny_refusion(architecture)
    converted = copy.deepcopy(model)
    torch.manual_seed(1)
    adapted = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    batch, sequences, _ = suffix_batch(decay=0.6)
    weight = batch.pop("mdm_token_weight")
    target = converted_model_log_probs(adapted, batch)
    logits = adapted(**batch).logits
    soft = refusion_soft_target_loss(
        logits, batch["is_masked"], target, batch["noise_level"], batch["response_length"], token_weight=weight
    )

    per_example, gap = [], 0.0
    with torch.no_grad():
        for b, sequence in enumerate(sequences):
            total = 0.0
            for i in batch["is_masked"][b].nonzero()[:, 0].tolist():
                q = int(batch["position_ids"][b, i])  # the true prefix is the sequence before position q
                prefix = torch.tensor([sequence[:q]])
                wanted = converted(input_ids=prefix).logits[0, -1].log_softmax(-1)
                gap = max(gap, float((adapted(input_ids=prefix).logits[0, -1].log_softmax(-1) - wanted).abs().max()))
                predicted = logits[b, i].detach().log_softmax(-1)
                total += float(weight[b, i]) * float((wanted.exp() * (wanted - predicted)).sum())
            per_example.append(total / (float(batch["noise_level"][b]) * int(batch["response_length"][b])))
    assert soft.item() == pytest.approx(sum(per_example) / len(per_example), rel=1e-6)
    assert gap > 1e-3, "the adapter changes the model, so the target must come from the adapter-free network"
    soft.backward()
    lora_grads = [p.grad for name, p in adapted.named_parameters() if "lora_" in name]
    assert lora_grads and all(g is not None for g in lora_grads) and any(g.abs().sum() > 0 for g in lora_grads)


def test_soft_target_loss_is_zero_when_the_model_predicts_the_target():
    batch, _, _ = suffix_batch(decay=None)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(*batch["labels"].shape, VOCAB, generator=generator).double()
    target = logits[batch["is_masked"]].log_softmax(-1)
    fields = (batch["noise_level"], batch["response_length"])
    assert refusion_soft_target_loss(logits, batch["is_masked"], target, *fields).abs().item() < 1e-12
    other = torch.randn(target.shape, generator=generator).double().log_softmax(-1)
    assert refusion_soft_target_loss(logits, batch["is_masked"], other, *fields).item() > 0.0
