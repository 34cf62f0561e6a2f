"""Streaming generation and the continuous-batching engine, checked against the unmodified model
(`model.generate`), against each request run alone, and against hand-made cases."""

from __future__ import annotations

import pytest
import torch

from allocmoe import AllocMoeError, allocate, apply_plan, generate, load_model, static_plan
from allocmoe.cli import main
from allocmoe.serve import Engine, Request, SamplingParams
from allocmoe.serve.plans import per_sequence
from allocmoe.serve.text import IncrementalText

PROMPTS = ["The king said", "Once upon a time there was", "In the beginning", "A man walked into the",
           "What is the", "She looked at him and", "And it came to pass that the people", "Why"]


@pytest.fixture(scope="module")
def builtin():
    return load_model()


@pytest.fixture(scope="module")
def plans(builtin):
    model, _ = builtin
    return {"full": static_plan(model, [6] * 6, method="full"),
            "alloc-t": per_sequence(allocate("1/2", "alloc-t", model=model)),
            "uniform": allocate("1/3", "uniform", model=model)}


def test_full_budget_plan_generates_what_the_unmodified_model_generates(builtin, plans):
    model, tok = builtin
    for prompt in PROMPTS[:3]:
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            expected = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=tok.eos_token_id)
        expected = expected[0, ids.size(1):].tolist()
        stream = generate(model, tok, prompt, plans["full"], max_new_tokens=24)
        text = "".join(stream)
        assert stream.token_ids == expected[:len(stream.token_ids)]
        assert len(stream.token_ids) == 24 or expected[len(stream.token_ids)] == tok.eos_token_id
        assert text == tok.decode(stream.token_ids, skip_special_tokens=True)


def test_a_reduced_plan_changes_the_output_and_its_measured_spend_matches_the_handle(builtin, plans):
    model, tok = builtin
    full = generate(model, tok, PROMPTS[1], None, max_new_tokens=24)
    list(full)
    stream = generate(model, tok, PROMPTS[1], plans["uniform"], max_new_tokens=24)
    list(stream)
    assert stream.token_ids != full.token_ids
    with apply_plan(model, plans["uniform"]) as handle:     # the same request through the handle's own count
        engine = Engine(model, tok, handle, max_batch_size=1)
        engine.submit(Request(tok(PROMPTS[1])["input_ids"], SamplingParams(max_new_tokens=24)))
        engine.run_until_idle()
        assert handle.activations_per_token() == pytest.approx(12.0)
    summary = stream.summary
    assert summary.prefill_activations_per_token == pytest.approx(12.0)
    assert summary.decode_activations_per_token == pytest.approx(12.0)
    assert summary.full_activations_per_token == 36.0 and full.summary.decode_activations_per_token == 36.0
    assert "decode 12.00 of 36 (full)" in summary.line()


def _run(engine: Engine, requests: list[Request], stagger: int = 0) -> list[Request]:
    """Submit requests (every `stagger` steps one more, 0 = all at once) and run to the end."""
    pending = list(requests)
    while pending or engine.load() != (0, 0):
        if pending:
            engine.submit(pending.pop(0))
            if stagger == 0:
                while pending:
                    engine.submit(pending.pop(0))
        for _ in range(max(stagger, 1)):
            engine.step()
    return requests


@pytest.mark.parametrize("stagger", [0, 2])
def test_requests_with_different_plans_in_one_batch_equal_each_alone(builtin, plans, stagger):
    """Eight requests over three plans, batched together (all at once, or joining mid-generation):
    each gets the tokens and the activations it gets alone."""
    model, tok = builtin
    names = list(plans)
    handle = apply_plan(model, list(plans.values())[0])
    for plan in list(plans.values())[1:]:
        handle.add_plan(plan)
    seen = []
    try:
        def make():
            return [Request(tok(p)["input_ids"], SamplingParams(max_new_tokens=12 + i, ignore_eos=True),
                            plan_index=i % len(names)) for i, p in enumerate(PROMPTS)]

        alone = [_run(Engine(model, tok, handle, max_batch_size=1), [r])[0] for r in make()]
        engine = Engine(model, tok, handle, max_batch_size=8, on_pass=seen.append)
        together = _run(engine, make(), stagger)
    finally:
        handle.remove()
    assert max(s.plans for s in seen) == 3 and max(s.rows for s in seen) >= 6
    for a, b in zip(alone, together):
        assert b.generated == a.generated and len(b.generated) == a.params.max_new_tokens
        assert b.prefill_activations == pytest.approx(a.prefill_activations)
        assert b.decode_activations == pytest.approx(a.decode_activations)
    spent = {names[r.plan_index]: r.activations_per_token("decode") for r in together}
    assert spent["full"] == 36 and spent["uniform"] == 12
    assert spent["alloc-t"] == pytest.approx(18, abs=1.0)    # Alloc-T rounds round(T * K) per layer and pass


def test_seeded_sampling_does_not_depend_on_the_batch(builtin):
    model, tok = builtin
    params = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)

    def request(prompt):
        return Request(tok(prompt)["input_ids"], params)

    alone = _run(Engine(model, tok, max_batch_size=1), [request(PROMPTS[0])])[0]
    mixed = _run(Engine(model, tok, max_batch_size=4), [request(p) for p in PROMPTS[:4]])
    assert mixed[0].generated == alone.generated
    other = _run(Engine(model, tok), [Request(tok(PROMPTS[0])["input_ids"], SamplingParams(
        max_new_tokens=16, temperature=0.9, top_p=0.9, seed=8, ignore_eos=True))])[0]
    assert other.generated != alone.generated


def test_a_cancelled_request_frees_its_slot_for_the_next(builtin):
    model, tok = builtin
    engine = Engine(model, tok, max_batch_size=1, max_queue=1)
    first = engine.submit(Request(tok(PROMPTS[0])["input_ids"], SamplingParams(max_new_tokens=100, ignore_eos=True)))
    second = engine.submit(Request(tok(PROMPTS[1])["input_ids"], SamplingParams(max_new_tokens=4, ignore_eos=True)))
    engine.step()
    assert engine.load() == (1, 1)
    engine.cancel(first)
    engine.run_until_idle()
    assert first.finish_reason == "cancelled" and len(first.generated) < 100
    assert second.finish_reason == "length" and len(second.generated) == 4


def test_stop_strings_cut_the_text_and_pieces_wait_until_settled(builtin):
    model, tok = builtin
    whole = "".join(generate(model, tok, PROMPTS[6], None, max_new_tokens=30))
    stop = whole[10:13]
    cut = generate(model, tok, PROMPTS[6], None, max_new_tokens=30, stop=[stop])
    pieces = list(cut)
    assert "".join(pieces) == whole[:whole.find(stop)] and cut.summary.finish_reason == "stop"
    # a hand-made case: bytes of one character split over two tokens never show half a character
    text = IncrementalText(tok, stop=("ab",))
    e_acute = tok("é", add_special_tokens=False)["input_ids"]
    for token in tok("xa", add_special_tokens=False)["input_ids"] + e_acute:
        text.add(token)
    assert text.take() + text.take(final=True) == "xaé"


def test_chat_needs_a_template_and_uses_the_one_given(tiny_folder):
    model, tok = load_model(tiny_folder)
    with pytest.raises(AllocMoeError, match="no chat template"):
        generate(model, tok, "hi", chat=True)
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    stream = generate(model, tok, "hi", chat=True, chat_template=template, max_new_tokens=3)
    assert stream.prompt_ids == tok("<user>hi<assistant>", add_special_tokens=False)["input_ids"]
    list(stream)


def test_prompts_past_the_context_and_bad_numbers_are_refused(builtin):
    model, tok = builtin
    with pytest.raises(AllocMoeError, match="context is 512 tokens"):
        generate(model, tok, "word " * 600)
    with pytest.raises(AllocMoeError, match="at most 509 new tokens"):
        generate(model, tok, "The king said", max_new_tokens=510)
    for bad in (dict(max_new_tokens=0), dict(temperature=float("nan")), dict(top_p=0.0), dict(stop=[""])):
        with pytest.raises(AllocMoeError):
            generate(model, tok, "hi", **bad)
    with pytest.raises(AllocMoeError, match="outside the vocabulary"):
        generate(model, tok, [1, 2, 10**6])


def test_generate_cli_streams_the_text_and_prints_one_summary_line(builtin, plans, tmp_path, capsys):
    model, tok = builtin
    plan_file = tmp_path / "third.json"
    plans["uniform"].save(plan_file)
    expected = "".join(generate(model, tok, PROMPTS[0], plans["uniform"], max_new_tokens=20))
    main(["generate", "--plan", str(plan_file), "--prompt", PROMPTS[0], "--max-new-tokens", "20"])
    out, err = capsys.readouterr()
    assert out == expected + "\n"
    summary = [line for line in err.splitlines() if line.startswith("prompt ")]
    assert len(summary) == 1 and "decode 12.00 of 36 (full)" in summary[0]
    main(["generate", "--prompt", "hi", "--chat", "--max-new-tokens", "4"])     # the built-in template


@pytest.mark.parametrize("argv, message", [
    (["--prompt", "hi", "--max-new-tokens", "0"], "max new tokens must be"),
    (["--prompt", "hi", "--top-p", "2"], "top_p must lie in"),
    (["--prompt-file", "/no/such/file"], "prompt file not found"),
    (["--prompt", ""], "the prompt is empty"),
    (["--prompt", "hi", "--plan", "/no/plan.json"], "plan file not found"),
    (["--prompt", "hi", "--chat-template", "/no/t.jinja", "--chat"], "chat template file not found"),
])
def test_generate_cli_refuses_bad_input_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and err[-1].startswith("allocmoe: error: ") and message in err[-1]


def test_generate_under_an_applied_plan_measures_through_its_handle(builtin, plans):
    model, tok = builtin
    with apply_plan(model, plans["uniform"]) as handle:
        stream = generate(model, tok, PROMPTS[2], max_new_tokens=8)
        list(stream)
        assert stream.summary.decode_activations_per_token == pytest.approx(handle.activations_per_token()) == 12
        with pytest.raises(AllocMoeError, match="already applied"):
            generate(model, tok, PROMPTS[2], plans["full"])
    assert stream.token_ids == generate_tokens(model, tok, PROMPTS[2], plans["uniform"], 8)


def generate_tokens(model, tok, prompt, plan, n):
    stream = generate(model, tok, prompt, plan, max_new_tokens=n)
    list(stream)
    return stream.token_ids


def test_extreme_temperature_and_top_p_still_sample_the_top_token():
    from allocmoe.serve.sampling import next_token

    logits = torch.tensor([0.5, 3.0, -1.0, 2.9])
    generator = torch.Generator().manual_seed(0)
    for params in (SamplingParams(temperature=1e-300), SamplingParams(temperature=1.0, top_p=5e-324)):
        assert {next_token(logits, params, generator) for _ in range(20)} == {1}
    # top_p = 0.6: token 1 holds softmax mass 0.50 < 0.6, so token 3 (0.45) joins it and no other does
    drawn = {next_token(logits, SamplingParams(temperature=1.0, top_p=0.6), generator) for _ in range(200)}
    assert drawn == {1, 3}
