"""LM RL: tiny LM built locally, data loaders, the rollout contract, GRPO that raises reward, resume."""

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlnb.components.lm import HFRollout, LMActor, RewardWorker
from rlnb.config import AlgorithmConfig, RecipeError, load_recipe
from rlnb.data import ArithmeticTask, Problem, load_qa_file
from rlnb.data.prompts import chat_prompts
from rlnb.errors import ComponentError, ConfigError, RemoteError
from rlnb.loop import GRPOLoop, complete_checkpoints
from rlnb.models.lm import (
    build_tiny_lm,
    length_buckets,
    load_lm,
    load_tokenizer,
    shared_prompt_logprobs,
    token_ends,
    token_logprobs,
)
from rlnb.runtime import rank as rank_mod
from tests.conftest import assert_metrics_documented, requires_gpu, without_wall_clock

QUIET = ["runner.tensorboard=false"]


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    return str(
        build_tiny_lm(tmp_path_factory.mktemp("lm") / "tiny", hidden_size=32, num_layers=1, num_heads=2)
    )


def test_tiny_lm_round_trip_and_missing_path(tiny_lm, tmp_path):
    model, tok = load_lm(tiny_lm)
    assert model.config.model_type == "qwen2" and model.config.vocab_size == len(tok)
    ids = tok(["12+3="], return_tensors="pt")["input_ids"]
    assert tok.decode(ids[0]) == "12+3="
    llama = build_tiny_lm(tmp_path / "llama", 32, 1, 2, arch="llama")
    assert load_lm(llama)[0].config.model_type == "llama"
    with pytest.raises(ConfigError, match="has no config.json: not a saved model"):
        load_lm(tmp_path / "nothing")
    with pytest.raises(ConfigError, match="must be divisible"):
        build_tiny_lm(tmp_path / "bad", hidden_size=30, num_heads=4)


def test_arithmetic_task_split_and_position():
    task = ArithmeticTask(max_operand=9, ops="+-", held_out_frac=0.25, seed=3)
    train, held = {p.prompt for p in task.train}, {p.prompt for p in task.held_out}
    assert not train & held and len(train) + len(held) == 200 and len(held) == 50
    assert all(str(eval(p.prompt[:-1])) == p.answer for p in task.train)
    first = task.sample(300)  # wraps over epochs
    again = ArithmeticTask(max_operand=9, ops="+-", held_out_frac=0.25, seed=3)
    again.sample(120)
    state = again.state_dict()
    resumed = ArithmeticTask(max_operand=9, ops="+-", held_out_frac=0.25, seed=3)
    resumed.load_state_dict(state)
    assert resumed.sample(180) == first[120:]
    with pytest.raises(ConfigError, match="data.ops: expected characters from"):
        ArithmeticTask(ops="/")


def test_qa_file_loaders(tmp_path):
    rows = [{"question": "Natalia sold 48 clips and half as many more. How many?", "answer": "48/2 = 24\n48+24 = 72\n#### 72"},
            {"question": "2+2?", "answer": "4"}]  # fmt: skip
    path = tmp_path / "gsm.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    problems = load_qa_file(path)
    assert [p.answer for p in problems] == ["72", "4"] and problems[0].prompt.startswith("Natalia")
    import pandas as pd

    pd.DataFrame(rows).to_parquet(tmp_path / "gsm.parquet")
    assert load_qa_file(tmp_path / "gsm.parquet") == problems
    (tmp_path / "bad.jsonl").write_text(json.dumps({"q": "x"}))
    with pytest.raises(ConfigError, match=r"row 0 of bad.jsonl has no \['question', 'answer'\]"):
        load_qa_file(tmp_path / "bad.jsonl")
    with pytest.raises(ConfigError, match="does not exist"):
        load_qa_file(tmp_path / "missing.jsonl")


def test_prompts_from_a_hugging_face_dataset_saved_to_disk(tmp_path):
    """data.path names a directory ``save_to_disk`` wrote: a Dataset, or a DatasetDict's ``train`` split."""
    datasets = pytest.importorskip(
        "datasets", reason="the `datasets` extra (rlnb[datasets]) is not installed"
    )
    rows = [{"question": f"{a}+{a}=", "answer": f"work\n#### {2 * a}", "level": a % 2} for a in range(6)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))
    problems = load_qa_file(tmp_path / "one")
    assert [(p.prompt, p.answer, p.fields) for p in problems[:2]] == [
        ("0+0=", "0", {"level": 0}),
        ("1+1=", "2", {"level": 1}),
    ]
    test_rows = [{"question": "9+9=", "answer": "18", "level": 1}]
    splits = {"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(test_rows)}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "dict"))
    assert load_qa_file(tmp_path / "dict") == problems  # its train split
    del splits["train"]
    splits["validation"] = splits["test"]
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "no_train"))
    with pytest.raises(ConfigError, match=r"has splits \['test', 'validation'\] and none named 'train'"):
        load_qa_file(tmp_path / "no_train")
    (tmp_path / "plain").mkdir()
    with pytest.raises(ConfigError, match="is a directory but not a dataset saved with save_to_disk"):
        load_qa_file(tmp_path / "plain")


class PeerHost:
    """What the worker's registry of rank hosts holds, for a component built in this process."""

    def __init__(self, obj):
        self.obj = obj


def test_hf_rollout_contract_and_logprob_agreement(tiny_lm):
    ro = HFRollout(tiny_lm, max_new_tokens=5, seed=0)
    # a reward worker as a collocated peer, as its rank host would register it (weakly: the test holds it)
    host = PeerHost(RewardWorker("arithmetic"))
    rank_mod._HOSTS[("", "reward-test", 0)] = host
    s = ro.generate(["1+2=", "13+4="], ["3", "17"], n=4, reward="reward-test")
    b = ro.take_batch()
    B, L = b["input_ids"].shape
    assert B == 8 and b["response_mask"].shape == (B, L) and b["logprobs"].shape == (B, L)
    assert b["rewards"].shape == (8,) and 0.0 <= s["reward_mean"] <= 1.0
    assert b["group_index"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    resp = b["response_mask"].bool()
    assert (b["logprobs"][~resp] == 0).all() and (b["logprobs"][resp] < 0).all()
    # the actor's recomputed log-probs of the same tokens match the sampler's
    model, _ = load_lm(tiny_lm)
    with torch.no_grad():
        again = token_logprobs(model, b["input_ids"], b["attention_mask"])
    assert torch.allclose(again[resp], b["logprobs"][resp], atol=1e-4)
    # two generations with the same seed and call count are identical
    ro2 = HFRollout(tiny_lm, max_new_tokens=5, seed=0)
    ro2.generate(["1+2=", "13+4="], ["3", "17"], n=4, reward="reward-test")
    assert torch.equal(ro2.take_batch()["input_ids"], b["input_ids"])
    del rank_mod._HOSTS[("", "reward-test", 0)]


def test_a_multi_turn_rollout_masks_the_interactions_replies_and_keeps_the_models_logprobs(tiny_lm):
    """max_turns=3: the model's turn, the interaction's reply to the transcript so far, the model's next turn
    from the transcript's token ids. The batch holds each whole transcript after its prompt: the replies
    attended to but out of the response mask, with no log-prob; every model token's sampling log-prob is the
    one the model gives it in the whole transcript. The interaction sees each completion's own record (answer,
    fields) and its turn, may end an episode early (None), and the texts are the transcripts."""
    seen = []

    def hint(completion, turn, answer, level, last_turn):
        seen.append((turn, answer, level))
        # the model's latest turn alone: all of it at first, then what follows the last reply
        assert last_turn == (completion if turn == 1 else completion.rsplit(f" hint{answer}:", 1)[1])
        return None if turn == 2 and level == 2 else f" hint{answer}:"

    ro = HFRollout(tiny_lm, max_new_tokens=4, seed=0, max_turns=3, interaction=hint)
    ro.generate(["1+2=", "13+4="], ["3", "17"], n=2, fields=[{"level": 1}, {"level": 2}])
    b = ro.take_batch()
    assert sorted(seen) == [(1, "17", 2)] * 2 + [(1, "3", 1)] * 2 + [(2, "17", 2)] * 2 + [(2, "3", 1)] * 2
    texts = b["texts"]
    assert [t.count(" hint") for t in texts] == [2, 2, 1, 1]  # level 2 ended after its second turn
    assert all(" hint3:" in t for t in texts[:2]) and all(" hint17:" in t for t in texts[2:])
    resp, attended = b["response_mask"].bool(), b["attention_mask"].bool()
    assert (b["logprobs"][~resp] == 0).all() and (b["logprobs"][resp] < 0).all()
    tok = ro.tok
    for i, text in enumerate(texts):  # the transcript after the prompt, and the model's own tokens in it
        start = int(resp[i].nonzero()[0])
        after = attended[i] & (torch.arange(resp.shape[1]) >= start)
        assert tok.decode(b["input_ids"][i][after], skip_special_tokens=True) == text
        replies = tok.decode(b["input_ids"][i][after & ~resp[i]])
        assert replies == "".join(f" hint{['3', '17'][i // 2]}:" for _ in range(text.count(" hint")))
    model, _ = load_lm(tiny_lm)
    with torch.no_grad():
        again = token_logprobs(model, b["input_ids"], b["attention_mask"])
    assert torch.allclose(again[resp], b["logprobs"][resp], atol=1e-4)
    # greedy transcripts for evaluation, each prompt's own answer and fields given to the interaction
    seen.clear()
    done = ro.complete(["1+2="], ["3"], [{"level": 1}])
    assert len(done) == 1 and done[0].count(" hint3:") == 2 and [s[0] for s in seen] == [1, 2]


def test_a_transcript_whose_next_turn_would_not_fit_the_models_positions_ends_before_that_reply(tiny_lm):
    """The tiny model has 128 positions: after a 61-token reply the next would take a transcript past them, so
    each ends after its second turn, the reply that would not fit left out, and generation_stats() counts them."""
    ro = HFRollout(
        tiny_lm, max_new_tokens=4, seed=0, max_turns=4, interaction=lambda completion: " " + "x" * 60
    )
    ro.generate(["1+2=", "13+4="], ["3", "17"], n=2)
    b = ro.take_batch()
    assert [t.count(" " + "x" * 60) for t in b["texts"]] == [1] * 4
    assert b["attention_mask"].sum(1).max() <= 128 and ro.generation_stats()["turns_cut"] == 4


def test_multi_turn_settings_are_refused_before_launch():
    with pytest.raises(ConfigError, match=r"max_turns: expected an integer in \[1, 1000\], got 0"):
        HFRollout.prepare_launch({"model_path": "m", "max_turns": 0})
    with pytest.raises(ConfigError, match="interaction: with max_turns=2 something must answer"):
        HFRollout.prepare_launch({"model_path": "m", "max_turns": 2})
    with pytest.raises(
        ConfigError, match="unknown interaction 'arithmetic_retyr'.*Did you mean 'arithmetic_retry'"
    ):
        HFRollout.prepare_launch({"model_path": "m", "max_turns": 2, "interaction": "arithmetic_retyr"})
    with pytest.raises(ConfigError, match="unknown interaction '42'"):
        HFRollout.prepare_launch({"model_path": "m", "max_turns": 2, "interaction": 42})
    ok = HFRollout.prepare_launch({"model_path": "m", "max_turns": 2, "interaction": "ARITHMETIC_retry"})
    assert ok["interaction"].name == "arithmetic_retry"


def test_completions_share_their_prompts_prefill_on_a_worker_with_the_same_tokens_and_logprobs(
    cluster, tiny_lm
):
    prompts, answers = ["1+2=", "13+4=", "7="], ["3", "17", "7"]  # prompts of different lengths (padding)
    batches = {}
    for share in (True, False):
        rollout = HFRollout.launch(
            cluster, "0", model_path=tiny_lm, max_new_tokens=6, seed=3, share_prompt_prefill=share,
            name=f"rollout_share_{share}",
        )  # fmt: skip
        rollout.generate(prompts, answers, n=4).result(120)
        batches[share] = rollout.take_batch().result(60)[0]
        stats = rollout.generation_stats().result(60)[0]
        assert stats == {
            "drop_finished": True, "shared_prefills": int(share), "prefill_fallback": None, "decode_fallback": None,
            "turns_cut": 0,
        }  # fmt: skip
        rollout.shutdown()
    shared, alone = batches[True], batches[False]
    assert torch.equal(shared["input_ids"], alone["input_ids"])  # the same samples, token for token
    assert torch.equal(shared["response_mask"], alone["response_mask"])
    assert torch.allclose(shared["logprobs"], alone["logprobs"], atol=1e-5)


def _input_shapes(model) -> list:
    """A list to which each forward of ``model`` appends the shape of its ``input_ids`` (rows, columns)."""
    shapes = []
    model.register_forward_pre_hook(
        lambda module, args, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    return shapes


class RowCountingRollout(HFRollout):
    """Records how many rows each forward of its model takes, and how many columns (on the worker)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.shapes = _input_shapes(self.model)

    def forward_rows(self) -> list:
        return [rows for rows, _ in self.shapes]

    def forward_shapes(self) -> list:
        return self.shapes


def test_ended_sequences_leave_the_decoding_batch_on_a_worker_and_sampling_is_generates(cluster, tiny_lm):
    prompts, answers = ["1+2=", "13+4=", "7="], ["3", "17", "7"]
    batches, rows = {}, {}
    for drop in (True, False):
        # an untrained model: EOS is one token of ~90, so some of 48 rows end before 24 tokens, most do not
        rollout = RowCountingRollout.launch(
            cluster, "0", model_path=tiny_lm, max_new_tokens=24, temperature=0.7, top_p=0.9, top_k=20, seed=11,
            drop_finished=drop, name=f"rollout_drop_{drop}",
        )  # fmt: skip
        rollout.generate(prompts * 4, answers * 4, n=4).result(120)
        batches[drop] = rollout.take_batch().result(60)[0]
        rows[drop] = rollout.forward_rows().result(60)[0]
        stats = rollout.generation_stats().result(60)[0]
        assert stats["decode_fallback"] is None
        rollout.shutdown()
    decoding = rows[True][1:]  # after the shared prefill (12 distinct prompts)
    assert decoding[0] == 48 and decoding == sorted(decoding, reverse=True) and decoding[-1] < 48, decoding
    assert set(rows[False][1:]) == {48}  # generate: every row to the end
    dropped, kept = batches[True], batches[False]
    # the same sampling (temperature, then top-k, then top-p, with the same seed) until the first sequence ends
    response = dropped["response_mask"].bool()
    first = int(response.any(0).nonzero()[0])
    ends = response.sum(1)
    same = first + int(ends.min())  # columns both drew with every row still running
    assert torch.equal(dropped["input_ids"][:, :same], kept["input_ids"][:, :same])
    assert torch.allclose(dropped["logprobs"][:, :same], kept["logprobs"][:, :same], atol=1e-5)
    # generate's layout: padding after the EOS that ends a row, log-probs and mask 0 there
    model, tok = load_lm(tiny_lm)
    for row in range(48):
        end = first + int(ends[row])
        ids = dropped["input_ids"][row]
        assert (ids[end:] == tok.pad_token_id).all() and not dropped["logprobs"][row, end:].any()
        if end < len(ids):  # ended before its budget: on EOS
            assert int(ids[end - 1]) == tok.eos_token_id
    # the sampler's log-probs are of the distribution it drew from: the model's at temperature 0.7, top-p
    # renormalised, so each is the actor's full-distribution log-prob plus -log(the nucleus' mass) >= 0
    with torch.no_grad():
        again = token_logprobs(model, dropped["input_ids"], dropped["attention_mask"], temperature=0.7)
    nucleus = dropped["logprobs"][response] - again[response]
    assert (nucleus > -1e-4).all() and (nucleus > 1e-3).any()


class _TakesGenerateInputsOnly(HFRollout):
    """A model whose forward takes only the inputs ``generate`` passes (no ``position_ids``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        forward = self.model.forward

        def strict_forward(*a, **kw):
            if "position_ids" in kw:
                raise TypeError("forward() got an unexpected keyword argument 'position_ids'")
            return forward(*a, **kw)

        self.model.forward = strict_forward


def test_a_model_the_decoding_loop_cannot_drive_samples_with_generate_and_says_why(tiny_lm, caplog):
    prompts, answers = ["1+2=", "13+4="], ["3", "17"]
    plain = HFRollout(tiny_lm, max_new_tokens=5, seed=4, drop_finished=False, share_prompt_prefill=False)
    plain.generate(prompts, answers, n=4)
    fallback = _TakesGenerateInputsOnly(tiny_lm, max_new_tokens=5, seed=4, share_prompt_prefill=False)
    with caplog.at_level("WARNING", logger="rlnb"):
        fallback.generate(prompts, answers, n=4)
        first = fallback.take_batch()
        fallback.generate(prompts, answers, n=4)  # not tried again
    assert fallback.generation_stats()["decode_fallback"] == (
        "TypeError: forward() got an unexpected keyword argument 'position_ids'"
    )
    warned = [r.getMessage() for r in caplog.records if "rlnb's decoding loop failed" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("rollout[0]: decoding with transformers' generate")
    assert torch.equal(first["input_ids"], plain.take_batch()["input_ids"])  # generate, with the same seed


class _FailsOnItsFirstDecodingStep(HFRollout):
    """A model whose first one-token forward fails (after a shared prefill went through)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        forward, failed = self.model.forward, []

        def flaky_forward(*a, **kw):
            if kw["input_ids"].shape[1] == 1 and not failed:
                failed.append(True)
                raise RuntimeError("no one-token step here")
            return forward(*a, **kw)

        self.model.forward = flaky_forward


def test_a_call_that_falls_back_to_generate_counts_its_shared_prefill_once(tiny_lm):
    rollout = _FailsOnItsFirstDecodingStep(tiny_lm, max_new_tokens=5, seed=4)
    rollout.generate(["1+2=", "13+4="], ["3", "17"], n=4)
    stats = rollout.generation_stats()
    assert stats["decode_fallback"] == "RuntimeError: no one-token step here"
    assert stats["shared_prefills"] == 1  # one call, prefilled once by the loop and again by generate


class _UnsharableCache(HFRollout):
    """A model that fails on the shared prefill (as an architecture whose cache cannot be repeated
    would): the rollout must fall back to prefilling per completion."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        forward = self.model.forward

        def strict_forward(*a, **kw):
            if kw["input_ids"].shape[0] == 2:  # the two prompts alone: the shared prefill
                raise NotImplementedError("this cache cannot be repeated")
            return forward(*a, **kw)

        self.model.forward = strict_forward


def test_a_model_whose_cache_cannot_be_shared_prefills_per_completion_and_says_why(tiny_lm, caplog):
    prompts, answers = ["1+2=", "13+4="], ["3", "17"]
    plain = HFRollout(tiny_lm, max_new_tokens=5, seed=4, share_prompt_prefill=False)
    plain.generate(prompts, answers, n=4)
    fallback = _UnsharableCache(tiny_lm, max_new_tokens=5, seed=4)
    with caplog.at_level("WARNING", logger="rlnb"):
        fallback.generate(prompts, answers, n=4)
        first = fallback.take_batch()
        fallback.generate(prompts, answers, n=4)  # not tried again
    assert fallback.generation_stats() == {
        "drop_finished": True,
        "shared_prefills": 0,
        "prefill_fallback": "NotImplementedError: this cache cannot be repeated",
        "decode_fallback": None,
        "turns_cut": 0,
    }
    warned = [r.getMessage() for r in caplog.records if "prefilled once per completion" in r.getMessage()]
    assert warned == [
        "rollout[0]: prompts are prefilled once per completion; sharing them failed "
        "(NotImplementedError: this cache cannot be repeated)"
    ]
    assert torch.equal(first["input_ids"], plain.take_batch()["input_ids"])  # the same samples


def _two_rollout_batches(tiny_lm):
    """A GRPO batch as an actor holds it: two rollout ranks' batches (prompts of different widths,
    and response lengths, so one's responses start later), each prompt 4 times."""
    batches = []
    for prompts, answers, tokens in (
        (["1+2=", "13+4="], ["3", "17"], 5),
        (["7=", "2+2=", "1+1+1="], ["7", "4", "3"], 2),
    ):
        ro = HFRollout(tiny_lm, max_new_tokens=tokens, seed=len(prompts))
        ro.generate(prompts, answers, n=4)
        ro.set_rewards([float(i % 3 == 0) for i in range(4 * len(prompts))])
        batches.append(ro.take_batch())
    return batches


def test_each_prompt_computed_once_gives_the_same_logprobs_and_gradients(tiny_lm):
    model, _ = load_lm(tiny_lm)
    actor = LMActor(tiny_lm, group_size=4, seed=0)
    actor.set_batch(_two_rollout_batches(tiny_lm))
    b = actor.batch
    ids, attn, response = b["input_ids"], b["attention_mask"], b["response_mask"]
    starts = (response.cumsum(1) == 1).long().argmax(1)  # each row's first response column
    assert len(set(starts.tolist())) == 2  # responses start at two columns: the later ones share less
    mask = response.float()

    def loss_and_grads(fn):
        model.zero_grad()
        logp = fn()
        ((logp * mask).sum() / mask.sum()).backward()
        return logp.detach(), [p.grad.clone() for p in model.parameters()]

    plain, plain_grads = loss_and_grads(lambda: token_logprobs(model, ids, attn))
    shared, shared_grads = loss_and_grads(lambda: shared_prompt_logprobs(model, ids, attn, response))
    assert torch.allclose(shared * mask, plain * mask, atol=1e-5)  # every response position
    for a, b_ in zip(plain_grads, shared_grads):
        assert torch.allclose(a, b_, atol=1e-6, rtol=1e-4)
    # nothing to share: every prompt once, or no prompt column before the responses
    once = torch.tensor([0, 4])  # the first rollout batch's two prompts
    assert shared_prompt_logprobs(model, ids[once], attn[once], response[once]) is None
    assert shared_prompt_logprobs(model, ids[:, 3:], attn[:, 3:], response[:, 3:]) is None
    # or less to save than asked (a GPU's threshold): 16 of 20 rows repeat a 4-column prefix, 64 of 200 positions
    assert shared_prompt_logprobs(model, ids, attn, response, min_saved_fraction=0.33) is None
    assert shared_prompt_logprobs(model, ids, attn, response, min_saved_fraction=0.31) is not None


def test_logprobs_from_the_first_response_column_compute_only_the_logits_they_need(tiny_lm):
    model, _ = load_lm(tiny_lm)
    ro = HFRollout(tiny_lm, max_new_tokens=4, seed=1)
    ro.generate(["1+2=", "13+4="], ["3", "17"], n=2)
    b = ro.take_batch()
    ids, attn, response = b["input_ids"], b["attention_mask"], b["response_mask"]
    first = int(response.bool().any(0).nonzero()[0])
    shapes = []
    model.lm_head.register_forward_hook(lambda module, args, out: shapes.append(tuple(out.shape)))
    with torch.no_grad():
        full = token_logprobs(model, ids, attn)
        part = token_logprobs(model, ids, attn, from_column=first)
    length, vocab = ids.shape[1], model.config.vocab_size
    assert shapes == [(4, length, vocab), (4, length - first + 1, vocab)]  # the prompt's logits skipped
    assert torch.allclose(part[:, first:], full[:, first:], atol=1e-6) and not part[:, :first].any()

    class NoLogitsToKeep(torch.nn.Module):  # a model whose forward does not take logits_to_keep
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, input_ids, attention_mask, position_ids):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)

    with torch.no_grad():
        plain = token_logprobs(NoLogitsToKeep(), ids, attn, from_column=first)
    assert torch.allclose(plain, part, atol=1e-6)


def _ragged_batch(tiny_lm) -> dict:
    """A GRPO batch whose responses end at different columns, as EOS leaves them: 3 prompts x 4, each
    group with two 2-3-token responses and two of 16, the rest of a row padding."""
    ro = HFRollout(tiny_lm, max_new_tokens=16, seed=5)
    ro.generate(["1+2=", "13+4=", "2+2="], ["3", "17", "4"], n=4)
    ro.set_rewards([float(i % 3 == 0) for i in range(12)])
    b = ro.take_batch()
    first = int(b["response_mask"].bool().any(0).nonzero()[0])
    for row, keep in enumerate([2, 16, 3, 16] * 3):  # the row ends after `keep` response tokens
        b["response_mask"][row, first + keep :] = 0
        b["attention_mask"][row, first + keep :] = 0
        b["input_ids"][row, first + keep :] = ro.tok.pad_token_id
        b["logprobs"][row, first + keep :] = 0.0
    return b


def test_length_buckets_group_rows_by_where_they_end_when_it_saves_more_than_a_pass_costs():
    ends = torch.tensor([40, 12, 40, 11] * 32)
    (short, short_end), (long, long_end) = length_buckets(ends, start=4, max_buckets=4)
    assert (short_end, long_end) == (12, 40) and short.tolist() == list(range(1, 128, 2))
    assert long.tolist() == list(range(0, 128, 2))
    assert length_buckets(ends, 4, max_buckets=1) is None  # one pass asked for
    assert length_buckets(torch.full((64,), 30), 4, max_buckets=4) is None  # nothing to leave out
    # leaving out 2 rows x 28 positions saves less than a pass costs (64 positions): one pass
    assert length_buckets(torch.tensor([40] * 30 + [12] * 2), 4, max_buckets=4) is None
    spread = torch.randint(10, 2000, (512,), generator=torch.Generator().manual_seed(0))
    buckets = length_buckets(spread, 5, max_buckets=4)  # ~500 distinct ends: rounded onto 64 steps
    assert len(buckets) == 4 and sorted(torch.cat([r for r, _ in buckets]).tolist()) == list(range(512))
    assert all(int(spread[rows].max()) <= end for rows, end in buckets) and buckets[-1][1] == int(
        spread.max()
    )
    computed = sum(len(rows) * (end - 5) for rows, end in buckets)
    assert computed < 0.65 * 512 * (int(spread.max()) - 5)  # padding left out: 61% of one full-width pass
    mask = torch.tensor([[0, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    assert token_ends(mask, least=2).tolist() == [3, 5, 2]


def test_rows_in_length_buckets_give_the_same_logprobs_and_gradients(tiny_lm):
    model, _ = load_lm(tiny_lm)
    b = _ragged_batch(tiny_lm)
    ids, attn, response = b["input_ids"], b["attention_mask"], b["response_mask"]
    mask = response.float()
    shapes = _input_shapes(model)

    def loss_and_grads(fn):
        model.zero_grad()
        shapes.clear()
        logp = fn()
        ((logp * mask).sum() / mask.sum()).backward()
        return logp.detach(), [p.grad.clone() for p in model.parameters()], list(shapes)

    first = int(response.bool().any(0).nonzero()[0])
    plain, plain_grads, _ = loss_and_grads(lambda: token_logprobs(model, ids, attn, from_column=first))
    for fn in (
        lambda: token_logprobs(model, ids, attn, from_column=first, max_buckets=4),
        lambda: shared_prompt_logprobs(model, ids, attn, response, max_buckets=4),
    ):
        logp, grads, passes = loss_and_grads(fn)
        assert torch.allclose(logp * mask, plain * mask, atol=1e-5)  # every response position
        assert not logp[0::2, first + 3 :].any()  # past the short rows' pass: 0, no padding position computed
        for a, b_ in zip(plain_grads, grads):
            assert torch.allclose(a, b_, atol=1e-6, rtol=1e-4)
        # two passes of 6 rows, the short rows' cut 13 columns before the long ones'
        halves = sorted(width for rows, width in passes if rows == 6)
        assert len(halves) == 2 and halves[1] - halves[0] == 13, passes


class WidthRecordingActor(LMActor):
    """Records the shape of every batch its model's forward takes (on the worker). Its ``__init__(*args,
    **kwargs)`` passes ``length_buckets`` on: launch finds it among ``LMActor``'s arguments, not settings."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.shapes = _input_shapes(self.policy)

    def forward_shapes(self) -> list:
        """The shapes recorded since the last call."""
        shapes = list(self.shapes)
        self.shapes.clear()
        return shapes


def test_the_actor_trains_rows_in_length_buckets_on_a_worker_as_in_one_pass(cluster, tiny_lm):
    batch = _ragged_batch(tiny_lm)
    weights, metrics, shapes = {}, {}, {}
    for buckets in (1, None):  # None: automatic, up to 4 on CPU
        # two epochs and a KL to the reference: the update, and the old and reference log-probs' recompute
        actor = WidthRecordingActor.launch(
            cluster, "1", model_path=tiny_lm, group_size=4, update_epochs=2, num_minibatches=1, kl_coef=0.1, micro_batch_size=12,
            lr=1e-2, length_buckets=buckets, name=f"actor_buckets_{buckets}",
        )  # fmt: skip
        actor.set_batch([dict(batch)]).result(60)
        metrics[buckets] = actor.train().result(120)[0]
        weights[buckets] = actor.policy_state().result(60)[0]
        shapes[buckets] = actor.forward_shapes().result(60)[0]
        actor.shutdown()
    assert {rows for rows, _ in shapes[1]} == {3, 12}  # the 3 shared prompts, then all 12 rows at once
    halves = [width for rows, width in shapes[None] if rows == 6]
    assert len(halves) >= 6 and max(halves) - min(halves) == 13, shapes[None]  # old, reference, update
    for name, w in weights[1].items():
        if not name.endswith("k_proj.bias"):  # rounding-sized gradients under Adam: see the test below
            assert torch.allclose(w, weights[None][name], atol=1e-5), name
    assert metrics[1] == pytest.approx(metrics[None], rel=1e-4, abs=1e-6)
    with pytest.raises(ConfigError, match=r"length_buckets: expected an integer in \[1, 1024\], got 0"):
        LMActor(tiny_lm, group_size=4, length_buckets=0)


def _rewarded(batch: dict, rewards: list[float]) -> dict:
    return {**batch, "rewards": torch.tensor(rewards, dtype=torch.float32)}


def test_rows_without_advantage_stay_out_of_the_update_on_ddp_workers_and_training_is_unchanged(
    cluster, tiny_lm
):
    """A group whose completions all scored alike adds exactly 0 to PPO's loss and gradient: the update
    leaves its rows out (``skip_zero_advantage``), also where a DDP rank has nothing left to compute."""
    batch = _ragged_batch(tiny_lm)
    mixed = _rewarded(batch, [1, 0, 0, 1, 0, 0, 0, 0, 1, 1, 0, 1])  # group 1 (rows 4-7) scored alike
    flat = _rewarded(batch, [0] * 4 + [1] * 4 + [0] * 4)  # every group alike: nothing to learn
    steps = [(mixed, mixed), (mixed, flat), (flat, flat)]  # (rank 0's batch, rank 1's) at each step
    weights, metrics, rows, zero = {}, {}, {}, {}
    for skip in (False, True):
        actor = WidthRecordingActor.launch(
            cluster, "0-1", model_path=tiny_lm, group_size=4, update_epochs=1, num_minibatches=1, micro_batch_size=12,
            lr=1e-2, length_buckets=1, skip_zero_advantage=skip, name=f"actor_skip_{skip}",
        )  # fmt: skip
        actor.init_process_group(timeout_s=60)
        actor.setup_data_parallel().result(60)
        metrics[skip], rows[skip], zero[skip] = [], [], []
        for version, (b0, b1) in enumerate(steps):  # sampled by the current weights: one on-policy pass
            actor.call_each(
                "set_batch", [([dict(b0, version=version)],), ([dict(b1, version=version)],)]
            ).result(60)
            zero[skip].append([a["zero_advantage_frac"] for a in actor.compute_advantages().result(60)])
            metrics[skip].append(actor.train().result(120))
            rows[skip].append([max(r for r, _ in shapes) for shapes in actor.forward_shapes().result(60)])
        weights[skip] = actor.on(0).policy_state().result(60)[0]
        actor.shutdown()
    assert rows[False] == [[12, 12]] * 3
    # the update's widest pass per rank: 8 rows (2 groups), or 1 row with weight 0 (nothing to compute:
    # DDP's all-reduce still needs this rank's backward, and Adam steps on zero gradients as it would)
    assert rows[True] == [[8, 8], [8, 1], [1, 1]]
    computed = [[m["rows_computed_frac"] for m in step] for step in metrics[True]]
    assert computed == [[2 / 3, 2 / 3], [2 / 3, 0.0], [0.0, 0.0]]
    for name, w in weights[False].items():
        if not name.endswith("k_proj.bias"):  # rounding-sized gradients under Adam (see the test below)
            assert torch.allclose(w, weights[True][name], atol=1e-5), name
    for plain, skipped in zip(metrics[False], metrics[True]):
        for a, b in zip(plain, skipped):
            assert a.pop("rows_computed_frac") == 1.0 and b.pop("rows_computed_frac") < 1.0
            assert a == pytest.approx(b, rel=1e-4, abs=1e-6)
    expected = [1 / 3, 1 / 3, 1 / 3, 1.0, 1.0, 1.0]  # rows with no signal, per step and rank
    for run in (True, False):
        assert [frac for step in zero[run] for frac in step] == pytest.approx(expected)
    # every row is computed where leaving some out would change the update: a KL term in the loss
    one_pass = {"group_size": 4, "update_epochs": 1, "num_minibatches": 1, "micro_batch_size": 12}
    for settings in ({"kl_coef": 0.1}, {"skip_zero_advantage": False}):
        actor = LMActor(tiny_lm, **{**one_pass, **settings})
        actor.set_batch([dict(mixed)])
        assert actor.train()["rows_computed_frac"] == 1.0, settings

    def my_ppo(logprobs, old_logprobs, advantages, mask):  # not known to add 0 without advantage
        return -(advantages * (logprobs - old_logprobs.detach()).exp() * mask).sum() / mask.sum(), {}

    actor = LMActor(tiny_lm, **one_pass, policy_loss=my_ppo)
    actor.set_batch([dict(mixed)])
    assert actor.train()["rows_computed_frac"] == 1.0


@pytest.mark.parametrize("settings", [{"update_epochs": 2, "num_minibatches": 2}, {"version": -1}])
def test_rows_without_advantage_stay_out_of_several_epochs_and_of_a_stale_batch_too(tiny_lm, settings):
    """Over several epochs (the old log-probs recomputed) or on a batch sampled by older weights (the ratio to
    the behaviour policy), a row with no advantage still adds exactly 0: it is left out of the update and of
    the recompute, and training is the same; the loss's metrics are over the rows computed."""
    settings = dict(settings)
    behind = settings.pop("version", 0)  # -1: each batch sampled one version before the actor's
    batch = _ragged_batch(tiny_lm)
    mixed = _rewarded(batch, [1, 0, 0, 1, 0, 0, 0, 0, 1, 1, 0, 1])  # group 1 (rows 4-7) scored alike
    flat = _rewarded(batch, [0] * 4 + [1] * 4 + [0] * 4)  # then a batch with nothing to learn
    out, weights = {}, {}
    for skip in (False, True):
        actor = LMActor(
            tiny_lm, group_size=4, micro_batch_size=12, lr=1e-2, skip_zero_advantage=skip, **settings
        )
        out[skip] = []
        for step, b in enumerate((mixed, flat)):
            actor.set_batch([dict(b, version=step + behind)])
            out[skip].append({**actor.compute_advantages(), **actor.train()})
            if skip and step == 0:
                recomputed = actor.batch["old_logprobs"]
                assert (
                    not recomputed[4:8].any() and recomputed[[0, 1, 2, 3, 8, 9, 10, 11]].any()
                )  # not group 1
            if skip and step == 1:  # no row to compute: no recompute, and no drift over a stand-in row
                assert actor.batch["old_logprobs"] is None and "logprob_drift" not in out[skip][-1]
        weights[skip] = actor.policy_state()
    assert [o["rows_computed_frac"] for o in out[False]] == [1.0, 1.0]
    assert [o["rows_computed_frac"] for o in out[True]] == pytest.approx([2 / 3, 0.0])
    for plain, skipped in zip(out[False], out[True]):
        assert skipped["loss"] == pytest.approx(plain["loss"], rel=1e-4, abs=1e-6)
    # nothing computed but a stand-in row at weight 0, at ratio 1: its metrics say the policy did not move
    assert out[True][1]["approx_kl"] == 0.0 and out[True][1]["clip_frac"] == 0.0
    for name, w in weights[False].items():
        if not name.endswith("k_proj.bias"):  # rounding-sized gradients under Adam (see the test below)
            assert torch.allclose(w, weights[True][name], atol=1e-5), name


def test_the_actor_computes_each_prompt_once_on_a_worker_and_trains_as_if_it_did_not(cluster, tiny_lm):
    batches = _two_rollout_batches(tiny_lm)
    weights, stats, metrics = {}, {}, {}
    for share in (True, False):
        # two epochs and a KL to the reference: the update, and the old and reference log-probs' recompute
        actor = LMActor.launch(
            cluster, "1", model_path=tiny_lm, group_size=4, update_epochs=2, kl_coef=0.1, micro_batch_size=8,
            lr=1e-2, share_prompt_forward=share, name=f"actor_share_{share}",
        )  # fmt: skip
        actor.set_batch([dict(b) for b in batches]).result(60)
        metrics[share] = actor.train().result(120)[0]
        weights[share] = actor.policy_state().result(60)[0]
        stats[share] = actor.forward_stats().result(60)[0]
        actor.shutdown()
    # 20 rows in micro-batches of 8: each micro-batch's groups sit together (the update sorts its rows)
    assert stats[True]["shared_forwards"] >= 6 and stats[True]["prompt_forward_fallback"] is None
    assert stats[False] == {
        "length_buckets": 4, "skip_zero_advantage": True, "shared_forwards": 0, "prompt_forward_fallback": None,
        "packed": False, "packing_fallback": None,
    }  # fmt: skip
    for name, w in weights[True].items():
        # a key bias's gradient is zero but for rounding (softmax ignores a shift common to all keys),
        # and Adam turns rounding-sized gradients into full-sized steps: those weights differ by noise
        if not name.endswith("k_proj.bias"):
            assert torch.allclose(w, weights[False][name], atol=1e-5), name
    assert metrics[True] == pytest.approx(metrics[False], rel=1e-4, abs=1e-6)


def test_an_actor_whose_model_cannot_share_prompts_trains_per_sequence_and_says_why(tiny_lm, caplog):
    actor = LMActor(tiny_lm, group_size=4, seed=0, update_epochs=2)
    forward = actor.policy.forward

    def no_cache_forward(*a, **kw):
        if (
            kw.get("past_key_values", kw.get("cache")) is not None
        ):  # as a model whose cache cannot be repeated
            raise NotImplementedError("this cache cannot be repeated")
        return forward(*a, **kw)

    actor.policy.forward = no_cache_forward
    actor.set_batch(_two_rollout_batches(tiny_lm))
    with caplog.at_level("WARNING", logger="rlnb"):
        metrics = actor.train()
    assert math.isfinite(metrics["loss"])
    assert actor.forward_stats() == {
        "length_buckets": 4,
        "skip_zero_advantage": True,
        "shared_forwards": 0,
        "prompt_forward_fallback": "NotImplementedError: this cache cannot be repeated",
        "packed": False,
        "packing_fallback": None,
    }
    warned = [r.getMessage() for r in caplog.records if "sharing prompts failed" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith(
        "actor[0]: each sequence's prompt goes through the model"
    )


def test_the_warm_start_puts_the_answer_on_the_prompt_with_one_bos_for_a_tokenizer_that_adds_it(tmp_path):
    llama = str(build_tiny_lm(tmp_path / "llama", hidden_size=32, num_layers=1, num_heads=2, arch="llama"))
    actor = LMActor(llama, AlgorithmConfig(advantage="grpo", policy_loss="ppo", group_size=2), seed=0)
    tok = actor.tok
    assert tok("3+4=")["input_ids"][0] == tok.bos_token_id  # (as Llama's tokenizer: <bos> first)
    (row,), (mark,) = actor._sft_rows(["3+4="], ["7"])
    assert tok.convert_ids_to_tokens(row) == [
        "<bos>",
        "3",
        "+",
        "4",
        "=",
        "7",
        "<eos>",
    ]  # (was <bos> before 7)
    assert mark == [0, 0, 0, 0, 0, 1, 1]
    losses = actor.sft(["1+1=", "2+2="] * 4, ["2", "4"] * 4, steps=2, batch_size=8, lr=1e-3)
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)


def test_a_warm_start_in_calls_of_a_few_steps_is_the_warm_start_in_one(tiny_lm):
    """The driver's progress bar runs the warm start a few steps a call (sft_begin, then sft_steps): the same
    losses and weights as one sft() call; a call with nothing under way is refused."""
    algo = AlgorithmConfig(advantage="grpo", policy_loss="ppo", group_size=2)
    one, chunked = (LMActor(tiny_lm, algo, seed=0) for _ in range(2))
    args = (["1+1=", "2+2=", "3+3="] * 4, ["2", "4", "6"] * 4)
    losses = one.sft(*args, steps=7, batch_size=4, lr=1e-3, wrong_answers=["3", "5", "7"] * 4, wrong_prob=0.3)
    chunked.sft_begin(
        *args, steps=7, batch_size=4, lr=1e-3, wrong_answers=["3", "5", "7"] * 4, wrong_prob=0.3
    )
    parts = [chunked.sft_steps(3), chunked.sft_steps(3), chunked.sft_steps(3)]
    assert [len(p) for p in parts] == [3, 3, 1] and [x for p in parts for x in p] == losses
    for p, q in zip(one.policy.parameters(), chunked.policy.parameters()):
        assert torch.equal(p, q)
    with pytest.raises(RuntimeError, match="no warm start is under way"):
        chunked.sft_steps(1)


def test_the_rollout_inspector_shows_the_greedy_completion_token_by_token(tiny_lm):
    """``loop.inspect`` (a rollout rank's ``inspect``): the greedy completion a token a row, each its log-probability,
    its distribution's entropy and the top-k tokens; the tokens are those ``complete`` writes, and sampling draws
    nothing from the rollout's generator."""
    ro = HFRollout(tiny_lm, max_new_tokens=6, seed=1, temperature=1.0)
    calls = ro.calls  # (what each sampling call's seed is drawn from)
    rows = ro.inspect("3+4=", top_k=4)
    assert 1 <= len(rows) <= 6 and ro.calls == calls
    text = ro.tok.decode([r["id"] for r in rows], skip_special_tokens=True)
    assert text == ro.complete(["3+4="])[0]
    for r in rows:
        probs = [p for _, p in r["top"]]
        assert len(probs) == 4 and probs == sorted(probs, reverse=True) and sum(probs) <= 1 + 1e-6
        assert r["top"][0][0] == r["token"] and math.isclose(math.exp(r["logprob"]), probs[0], rel_tol=1e-5)
        assert 0 <= r["entropy"] <= math.log(len(ro.tok)) + 1e-6
    with pytest.raises(ValueError, match="top_k: expected an integer in"):
        ro.inspect("3+4=", top_k=0)


@pytest.mark.parametrize("preset", ["none", "dr_grpo", "gspo", "cispo"])
def test_sft_then_grpo_update_moves_the_right_way(tiny_lm, preset):
    """Each loss the presets name (PPO's, GSPO's sequence ratio, CISPO's weights) raises the rewarded
    completions' tokens and lowers the others' through the LM actor's update."""
    from rlnb.config.presets import PRESETS

    keys = PRESETS.get(preset, {"advantage": "grpo", "policy_loss": "ppo"})
    algo = AlgorithmConfig(**keys, group_size=4, num_minibatches=1, update_epochs=1)
    actor = LMActor(tiny_lm, algo, lr=1e-4, micro_batch_size=8, seed=0)
    losses = actor.sft(["1+1=", "2+2="] * 8, ["2", "4"] * 8, steps=30, batch_size=8, lr=3e-3)
    assert losses[-1] < losses[0] / 2
    ro = HFRollout(tiny_lm, max_new_tokens=3, seed=1)
    ro.load_weights(actor.policy_state(), 1)
    ro.generate(["1+1=", "2+2="], ["2", "4"], n=4)
    ro.set_rewards([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0])
    actor.set_batch([ro.take_batch()])
    actor.compute_advantages()
    b = actor.batch
    old, adv, mask = b["old_logprobs"], b["advantages"], b["response_mask"].float()
    actor.train()
    with torch.no_grad():
        new = token_logprobs(actor.policy, b["input_ids"], b["attention_mask"])
    assert float(((new - old) * adv * mask).sum()) > 0  # rewarded tokens up, the others down
    assert actor.loss.name == keys["policy_loss"]


PRESETS_DR = {"advantage": "grpo", "policy_loss": "ppo", "scale": "none", "agg": "seq-mean-token-sum-norm"}


def test_dr_grpos_constant_makes_the_update_the_same_however_wide_the_batch_is_padded(tiny_lm):
    """agg: seq-mean-token-sum-norm divides each completion's token sum by algorithm.agg_max_tokens: the same
    batch padded 3 columns wider gives the same gradient; by the batch's width instead (null), one smaller by the
    widths' ratio."""
    ro = HFRollout(tiny_lm, max_new_tokens=3, seed=1)
    ro.generate(["1+1=", "2+2="], ["2", "4"], n=2)
    ro.set_rewards([1.0, 0.0, 0.0, 1.0])
    batch = ro.take_batch()
    wide = dict(batch)
    for key in ("input_ids", "attention_mask", "response_mask", "logprobs"):
        pad = batch[key].new_full((batch[key].shape[0], 3), ro.tok.pad_token_id if key == "input_ids" else 0)
        wide[key] = torch.cat([pad, batch[key]], 1)  # (left padding, as the rollout pads)

    def grad_norm(b, constant):
        algo = AlgorithmConfig(**{**PRESETS_DR, "agg_max_tokens": constant}, group_size=2, num_minibatches=1,
                               update_epochs=1)  # fmt: skip
        actor = LMActor(tiny_lm, algo, lr=1e-2, micro_batch_size=8, seed=0, anneal_lr=False)
        actor.set_batch([dict(b)])
        return actor.train()["grad_norm"]

    # (the gradient, not the weights after the step: Adam's first step is lr * sign(grad) wherever the gradient
    # is not ~0, so the weights tell a scaled loss from another only through its eps, and the last bits of a
    # padded batch's sums differ between CPUs)
    assert grad_norm(batch, 8) == pytest.approx(grad_norm(wide, 8), rel=1e-5)
    width, wider = batch["input_ids"].shape[1], wide["input_ids"].shape[1]
    assert grad_norm(batch, None) / grad_norm(wide, None) == pytest.approx(wider / width, rel=1e-4)


def test_a_mismatch_correction_weighs_each_tokens_loss_by_trainer_over_engine(tiny_lm):
    """algorithm.mismatch_correction through the LM actor's update: with the engine's log-probs the trainer's own,
    the weights are 1 and the update is the uncorrected one; with the engine's shifted (as a bf16 engine's are),
    TIS truncates and MIS masks, the update differs, and rollout/is_* say by how much."""
    ro = HFRollout(tiny_lm, max_new_tokens=3, seed=1)
    ro.generate(["1+1=", "2+2="], ["2", "4"], n=2)
    ro.set_rewards([1.0, 0.0, 0.0, 1.0])
    batch = ro.take_batch()

    def trained(b, **correction):
        algo = AlgorithmConfig(advantage="grpo", policy_loss="ppo", group_size=2, num_minibatches=1,
                               update_epochs=1, **correction)  # fmt: skip
        actor = LMActor(tiny_lm, algo, lr=1e-2, micro_batch_size=8, seed=0, anneal_lr=False)
        with torch.no_grad():  # the trainer's own log-probs as the engine's: they agree exactly
            own = token_logprobs(actor.policy, b["input_ids"], b["attention_mask"])
        actor.set_batch([{**b, "logprobs": own * b["response_mask"] + b.get("shift", 0.0)}])
        out = actor.train()
        return actor.policy_state(), out

    def same(a, b):
        return all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)

    plain, _ = trained(batch)
    agree, out = trained(batch, mismatch_correction="tis")
    assert same(plain, agree) and out["rollout/is_ratio_mean"] == pytest.approx(1.0, abs=1e-5), out
    assert out["rollout/is_clipped_frac"] == 0.0 and abs(out["rollout/is_kl"]) < 1e-6, out
    # the engine gave every other trained token 2 nats less than the trainer does: trainer / engine = e^2 > 2
    shift = torch.zeros_like(batch["logprobs"])
    shift[:, ::2] = -2.0
    shifted = {**batch, "shift": shift * batch["response_mask"]}
    tis, out = trained(shifted, mismatch_correction="tis", mismatch_cap=2.0)
    assert 0.2 < out["rollout/is_clipped_frac"] < 0.8 and out["rollout/is_kl"] > 0.5, out
    mis, out = trained(shifted, mismatch_correction="mis", mismatch_cap=2.0)
    assert 0.2 < out["rollout/is_masked_frac"] < 0.8, out
    assert not same(plain, tis) and not same(plain, mis) and not same(tis, mis)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_packed_micro_batches_by_a_token_budget_train_as_the_padded_rows_do(tiny_lm, agg):
    """actor.max_tokens_per_micro_batch: rows packed into one sequence a micro-batch, no padding computed, the
    micro-batches cut by tokens: the same loss and gradients as padded micro-batches of rows, and the same
    log-probs where the actor recomputes them (old log-probs, the KL reference)."""
    batches = _two_rollout_batches(tiny_lm)

    def trained(**settings):
        algo = AlgorithmConfig(advantage="grpo", policy_loss="ppo", group_size=4, num_minibatches=1,
                               update_epochs=1, agg=agg)  # fmt: skip
        actor = LMActor(tiny_lm, algo, lr=1e-2, seed=0, anneal_lr=False, compile=False, **settings)
        actor.set_batch([dict(b) for b in batches])
        logp = actor._logprobs(actor.policy, actor.batch)  # (before the step: the same weights)
        out = actor.train()
        return actor, out, logp

    padded, out_padded, logp_padded = trained(micro_batch_size=64)
    budget = int(padded.batch["attention_mask"].sum(1).max()) * 3  # (about three rows a micro-batch)
    packed, out_packed, logp_packed = trained(max_tokens_per_micro_batch=budget)
    assert packed.forward_stats()["packed"] and packed.packing_fallback is None
    assert out_packed["loss"] == pytest.approx(out_padded["loss"], abs=1e-5)
    at = padded.batch["response_mask"].bool()
    assert torch.allclose(logp_packed[at], logp_padded[at], atol=1e-5)
    grads = [(a.grad, b.grad) for a, b in zip(padded.policy.parameters(), packed.policy.parameters())]
    assert all(g is not None for g, _ in grads) and any(float(g.abs().max()) > 0 for g, _ in grads)
    assert all(torch.allclose(g, h, atol=1e-6, rtol=1e-4) for g, h in grads)


GRPO_SMALL = [
    "data.max_operand=9", "actor.sft_steps=150", "actor.tiny_lm.hidden_size=64", "runner.eval_interval=0",
    "data.eval_size=40", *QUIET,
]  # fmt: skip


def test_grpo_raises_reward(cluster, tmp_path):
    overrides = [*GRPO_SMALL, f"actor.model_path={tmp_path / 'model'}", "runner.steps=60"]
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "run") as loop:
        loop.run(progress=False)
        rewards = [r["reward/mean"] for r in loop.history if "reward/mean" in r]
        assert len(rewards) == 60
        first, last = sum(rewards[:15]) / 15, sum(rewards[-15:]) / 15
        assert last > first + 0.05, (first, last)
        assert (tmp_path / "run" / "sft_model" / "config.json").exists()  # HF-format warm start
        assert any("eval/accuracy" in r and r["step"] == 0 for r in loop.history)
        # both DDP ranks computed each prompt once (calling the DDP wrapper twice a micro-batch)
        for stats in loop.groups["actor"].forward_stats().result(60):
            assert stats["prompt_forward_fallback"] is None and stats["shared_forwards"] >= 60, stats
        # groups whose completions all scored alike stayed out of the update, on both DDP ranks
        computed = [r["train/rows_computed_frac"] for r in loop.history if "train/rows_computed_frac" in r]
        assert len(computed) == 60 and min(computed) < 1.0, computed
        rank0, rank1 = loop.groups["actor"].policy_state().result(60)  # DDP kept the replicas equal
        assert all(torch.equal(w, rank1[name]) for name, w in rank0.items())
        # the trained model in Hugging Face format, as transformers loads it, and nothing left beside it
        exported = loop.export()
        assert exported == tmp_path / "run" / "model"
        model = AutoModelForCausalLM.from_pretrained(exported)
        assert model.state_dict().keys() == rank0.keys()
        assert all(torch.equal(w, rank0[name]) for name, w in model.state_dict().items())
        assert AutoTokenizer.from_pretrained(exported)("3+4=")["input_ids"]
        assert not [p for p in (tmp_path / "run").iterdir() if p.name.startswith(".") and p.name != ".lock"]
        for k in (
            "rollout/tokens_per_s",
            "rollout/response_len_mean",
            "reward/accuracy",
            "train/clip_frac",
            "time/train_s",
        ):
            assert k in loop.history[-1], k
    assert_metrics_documented(tmp_path / "run")


def test_a_preset_from_the_command_line_trains_on_workers_and_its_run_directory_reloads(cluster, tmp_path):
    """``algorithm.preset=gspo`` over grpo_arith (whose file sets agg and clip otherwise): the actor on its
    worker trains with GSPO's loss and bounds, and the run directory's recipe (the preset and its keys) loads
    again as it ran."""
    overrides = [*GRPO_SMALL, f"actor.model_path={tmp_path / 'model'}", "runner.steps=2", "actor.sft_steps=20",
                 "algorithm.preset=gspo"]  # fmt: skip
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "run") as loop:
        records = [r for r in loop.run(progress=False) if "train/clip_frac" in r]
        assert len(records) == 2 and all(math.isfinite(r["train/loss"]) for r in records)
        settings = loop.groups["actor"].describe().result(60)[0]
        algo = settings["algorithm"]
        assert (settings["policy_loss"], algo["clip_coef"], algo["agg"]) == (
            "gspo",
            3e-4,
            "seq-mean-token-mean",
        )
        ro = loop.recipe.rollout  # Dr. GRPO's constant, filled by the family: the response-token budget
        assert algo["agg_max_tokens"] == ro.max_new_tokens * ro.max_turns
    again = load_recipe(tmp_path / "run" / "recipe.yaml").algorithm
    assert (again.preset, again.policy_loss, again.clip_coef_high) == ("gspo", "gspo", 4e-4)


LEVERS = {
    # two FSDP2 ranks (the recipe's placement) holding the model in bf16: seen 0.53 -> 0.87
    "fsdp2+bf16": ["actor.strategy=fsdp2", "actor.dtype=bfloat16"],
    # rollout a version ahead of the actor on a slot of its own; a shorter warm start leaves room: seen 0.33 -> 0.60
    "async": [
        "algorithm.max_staleness=1",
        "cluster.component_placement={'rollout,reward': 0, actor: 1}",
        "actor.sft_steps=100",
    ],
    # PPO with a value model (a copy of the policy's transformer and a value head), 2 DDP ranks: seen 0.40 -> 0.93
    "ppo+critic": ["algorithm.advantage=token_gae", "algorithm.gamma=1.0", "actor.critic_lr=0.001"],
}


@pytest.mark.parametrize("lever", list(LEVERS))
def test_grpo_arith_learns_with_each_lever(cluster, tmp_path, lever):
    """The flagship recipe, made small, raises held-out accuracy by at least 0.10 with FSDP2 + bf16 and
    asynchronously (LoRA: tests/test_lora.py; vLLM: tests/test_vllm.py)."""
    overrides = [*GRPO_SMALL, f"actor.model_path={tmp_path / 'model'}", "runner.steps=60", "data.eval_size=100",
                 "runner.eval_interval=60", *LEVERS[lever]]  # fmt: skip
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "run") as loop:
        loop.run(progress=False)
        evals = [r["eval/accuracy"] for r in loop.history if "eval/accuracy" in r]
        stale = [r["rollout/staleness_max"] for r in loop.history if "rollout/staleness_max" in r]
        described = loop.groups["actor"].describe().result(60)[0]
    assert evals[-1] >= evals[0] + 0.10, (lever, evals)
    if lever == "async":
        assert max(stale) == 1, stale
    elif lever == "ppo+critic":
        losses = [r["train/value_loss"] for r in loop.history if "train/value_loss" in r]
        assert len(losses) == 60 and sum(losses[-10:]) < sum(losses[:10]), losses  # the critic fits
    else:
        assert described["actor"].strategy == "fsdp2" and described["actor"].dtype == "bfloat16"


def test_ppo_with_a_value_model_resumes_exactly(cluster, tmp_path):
    """algorithm.advantage=token_gae: the critic's weights and AdamW state are in the checkpoint; a run cut at step 2
    and resumed logs what the whole run logged, value loss included."""
    base = [*GRPO_SMALL, f"actor.model_path={tmp_path / 'model'}", "runner.steps=4", "runner.save_interval=2",
            "actor.sft_steps=20", "algorithm.advantage=token_gae", "algorithm.gamma=1.0"]  # fmt: skip

    def numbers(records):
        return [without_wall_clock(r) for r in records]

    with GRPOLoop.from_recipe("grpo_arith", base, cluster=cluster, run_dir=tmp_path / "full") as loop:
        full = numbers(loop.run(progress=False))
    assert all("train/value_loss" in r for r in full)
    with GRPOLoop.from_recipe("grpo_arith", base, cluster=cluster, run_dir=tmp_path / "cut") as loop:
        loop.run(2, progress=False)
    with GRPOLoop.resume(tmp_path / "cut", cluster=cluster) as loop:
        assert numbers(loop.run(progress=False)) == full[2:]


def test_grpo_resume_is_exact_and_reward_can_sit_elsewhere(cluster, tmp_path):
    base = [*GRPO_SMALL, f"actor.model_path={tmp_path / 'model'}", "runner.steps=4", "runner.save_interval=2",
            "actor.sft_steps=20", "cluster.component_placement={'actor,rollout': 0, reward: 1}"]  # fmt: skip

    def numbers(records):
        return [without_wall_clock(r) for r in records]

    with GRPOLoop.from_recipe("grpo_arith", base, cluster=cluster, run_dir=tmp_path / "full") as loop:
        assert not loop.reward_local
        full = numbers(loop.run(progress=False))
    assert (complete_checkpoints(tmp_path / "full")[-1] / "hf" / "config.json").exists()
    with GRPOLoop.from_recipe("grpo_arith", base, cluster=cluster, run_dir=tmp_path / "cut") as loop:
        loop.run(2, progress=False)
    with GRPOLoop.resume(tmp_path / "cut", cluster=cluster) as loop:
        assert loop.step == 2 and loop.sft_done
        assert numbers(loop.run(progress=False)) == full[2:]


def test_lm_recipe_errors():
    with pytest.raises(RecipeError) as e:
        load_recipe("grpo_arith", ["actor.model_path=/nonexistent/model", "actor.build_if_missing=false",
                                   "algorithm.group_size=1", "rollout.temperature=0", "data.task=file",
                                   "actor.length_buckets=0"])  # fmt: skip
    msg = str(e.value)
    assert "actor.length_buckets: expected an integer in [1, 1024], got 0" in msg
    assert "actor.model_path: '/nonexistent/model' has no config.json" in msg
    assert "algorithm.group_size: grpo needs at least 2 samples per prompt, got 1" in msg
    assert "rollout.temperature: expected a number in (0, 1000000], got 0.0" in msg
    assert (
        "data.path: data.task=file needs an existing .jsonl/.parquet file or a dataset saved with save_to_disk, got None"
        in msg
    )
    with pytest.raises(
        RecipeError, match=r"data.path: 'qa.jsonl' is set, but data.task is 'arithmetic'.*data.task=file"
    ):
        load_recipe("grpo_arith", ["data.path=qa.jsonl"])  # silently trained on arithmetic before
    with pytest.raises(
        RecipeError, match=r"data.system_prompt: 'Be brief.' is set, but data.chat_template is false"
    ):
        load_recipe("grpo_arith", ["data.system_prompt=Be brief."])
    with pytest.raises(
        RecipeError, match=r"algorithm.mismatch_correction: tis with algorithm.policy_loss decoupled"
    ):
        load_recipe(
            "grpo_arith", ["algorithm.mismatch_correction=tis", "algorithm.policy_loss=decoupled_ppo"]
        )
    with pytest.raises(RecipeError, match=r"algorithm.mismatch_correction: mis weighs an LM engine's tokens"):
        load_recipe("ppo_cartpole", ["algorithm.mismatch_correction=mis"])
    with pytest.raises(RecipeError, match=r"algorithm.mismatch_cap: expected a number in \(1, 1000000\]"):
        load_recipe("grpo_arith", ["algorithm.mismatch_correction=tis", "algorithm.mismatch_cap=1"])


def test_chat_templated_prompts_get_one_bos_in_generation_and_in_the_warm_start(tmp_path):
    """A chat template that writes the tokenizer's <bos> itself (Llama 3's, Gemma's) with a tokenizer that also
    adds one (Llama's): prompts are tokenized without adding a second, as TRL tokenizes them."""
    llama = str(build_tiny_lm(tmp_path / "llama", hidden_size=32, num_layers=1, num_heads=2, arch="llama"))
    tok = load_lm(llama)[1]
    (problem,) = chat_prompts([Problem("3+4=", "7")], tok, system_prompt="Answer with a number.")
    assert problem == Problem("<bos>Answer with a number.\nQ: 3+4=\nA: ", "7")
    rollout = HFRollout(llama, max_new_tokens=2, seed=0)
    rollout.generate([problem.prompt, "2+2="], [problem.answer, "4"], n=2)
    batch = rollout.take_batch()
    prompt_part = batch["attention_mask"].bool() & ~batch["response_mask"].bool()
    bos_per_row = ((batch["input_ids"] == tok.bos_token_id) & prompt_part).sum(1)
    assert bos_per_row.tolist() == [1, 1, 1, 1]  # (the templated rows had two)
    actor = LMActor(llama, AlgorithmConfig(advantage="grpo", policy_loss="ppo", group_size=2), seed=0)
    (row,), _ = actor._sft_rows([problem.prompt], [problem.answer])
    assert tok.convert_ids_to_tokens(row).count("<bos>") == 1
    bare = load_lm(tiny_lm_without_template(tmp_path))[1]
    with pytest.raises(ConfigError, match="data.chat_template: the model's tokenizer has no chat template"):
        chat_prompts([problem], bare)


def tiny_lm_without_template(tmp_path):
    """A base model's directory: its tokenizer has no chat template."""
    path = build_tiny_lm(tmp_path / "base", hidden_size=32, num_layers=1, num_heads=2)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.jinja").unlink(missing_ok=True)
    return str(path)


def test_a_chat_template_recipe_trains_on_templated_prompts_on_workers(cluster, tmp_path):
    overrides = [*GRPO_SMALL, f"actor.model_path={tmp_path / 'model'}", "runner.steps=1", "actor.sft_steps=20",
                 "actor.tiny_lm.arch=llama", "data.chat_template=true", "data.system_prompt=Answer with a number."]  # fmt: skip
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "run") as loop:
        loop.run(progress=False)
        row = loop.sample_group(0)[0]
        tried = loop.try_prompt("3+4=", "7")
        inspected = loop.inspect("3+4=", top_k=3)  # the question through the template, as training gives it
        templated = (
            loop.groups["rollout"].on(0).template_prompts(["3+4="], "Answer with a number.").result(60)[0]
        )
        greedy = loop.groups["rollout"].on(0).complete(templated).result(60)[0][0]
        tok = load_tokenizer(loop.model_path)
    assert list(inspected.columns) == ["token", "id", "logprob", "entropy", "top"]
    assert tok.decode(list(inspected["id"]), skip_special_tokens=True) == greedy
    question = row["prompt"].removeprefix("Answer with a number.\nQ: ").removesuffix("\nA: ")
    assert row["prompt"] == f"Answer with a number.\nQ: {question}\nA: " and question.endswith("=")
    assert row["prompt_tokens"] == f"<bos>{row['prompt']}"  # one <bos>, the template's
    assert len(tried) == loop.recipe.algorithm.group_size


def test_the_lm_speed_options_of_a_recipe_reach_the_components_on_workers(cluster, tmp_path):
    """``actor.length_buckets``, ``actor.skip_zero_advantage``, ``rollout.drop_finished`` (defaults: 4 on CPU, on,
    on) and ``actor.max_tokens_per_micro_batch`` set in a recipe are what the actor and rollout ranks use."""
    overrides = [*GRPO_SMALL, f"actor.model_path={tmp_path / 'model'}", "runner.steps=2", "actor.sft_steps=0",
                 "actor.length_buckets=2", "actor.skip_zero_advantage=false", "rollout.drop_finished=false",
                 "actor.max_tokens_per_micro_batch=256"]  # fmt: skip
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "run") as loop:
        records = loop.run(progress=False)
        for stats in loop.groups["actor"].forward_stats().result(60):
            assert (stats["length_buckets"], stats["skip_zero_advantage"]) == (2, False), stats
            assert stats["packed"] and stats["packing_fallback"] is None, stats  # (packed micro-batches)
        for stats in loop.groups["rollout"].generation_stats().result(60):
            assert stats["drop_finished"] is False, stats
    # an untrained model: most groups scored alike (no signal), and every row was computed all the same
    assert all(r["advantages/zero_advantage_frac"] > 0.5 for r in records), records
    assert [r["train/rows_computed_frac"] for r in records] == [1.0, 1.0]


@requires_gpu
def test_micro_batches_accumulate_to_the_full_batch_gradient_and_kl(tiny_lm):
    ro = HFRollout(tiny_lm, max_new_tokens=3, seed=2)
    ro.generate(["1+1=", "2+3="], ["2", "5"], n=4)
    ro.set_rewards([1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    batch = ro.take_batch()
    updated = []
    for micro in (8, 2):
        algo = AlgorithmConfig(advantage="grpo", policy_loss="ppo", group_size=4, num_minibatches=1,
                               update_epochs=1, kl_coef=0.1, kl_estimator="k3")  # fmt: skip
        actor = LMActor(tiny_lm, algo, lr=1e-3, micro_batch_size=micro, seed=0)
        actor.set_batch([dict(batch)])
        actor.compute_advantages()
        metrics = actor.train()
        assert metrics["kl"] == pytest.approx(
            0.0, abs=1e-6
        )  # the reference equals the policy before the update
        updated.append(torch.cat([p.detach().flatten() for p in actor.policy.parameters()]))
    # 4 micro-batches of 2 == one batch of 8, to rounding: Adam turns rounding-sized gradient differences
    # into steps of ~1e-6 here, where a wrong accumulation would be off by ~lr = 1e-3
    assert torch.allclose(updated[0], updated[1], atol=1e-5)


def test_one_group_and_one_prompt_can_be_looked_at(cluster, tmp_path):
    """What the GRPO notebook shows: a prompt's group from the training batch, with rewards and their
    normalised advantages, and fresh completions of any prompt before and after training, which leave the
    run's sampling seeds as they were."""
    overrides = [*GRPO_SMALL, f"actor.model_path={tmp_path / 'model'}", "runner.steps=1"]
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "run") as loop:
        size = loop.recipe.algorithm.group_size
        with pytest.raises(ConfigError, match=r"size: expected an integer in \[1, 10000000\], got 0"):
            loop.evaluate(0)  # (0 held-out problems was a division by zero)
        loop.sft()
        calls = loop.groups["rollout"].on(0).state_dict().result()[0]["calls"]
        tried = loop.try_prompt("3+4=", "7")
        assert len(tried) == size and all(set(r) == {"completion", "reward", "advantage"} for r in tried)
        assert loop.groups["rollout"].on(0).state_dict().result()[0]["calls"] == calls
        loop.sync_weights()
        loop.rollout()
        rows = loop.sample_group(0)
        assert len(rows) == size and "advantage" not in rows[0] and rows[0]["prompt"].endswith("=")
        with pytest.raises(RemoteError, match=r"expected a group in 0-\d+ of this batch, got 999"):
            loop.sample_group(999)  # (was an empty list)
        loop.advantages()
        rows = loop.sample_group(0)
        assert loop.sample() == rows  # (what `rlnb.attach(...).sample()` shows: the first group)
        rewards = torch.tensor([r["reward"] for r in rows])
        expected = (rewards - rewards.mean()) / (rewards.std() + 1e-6)  # GRPO, scale=group
        assert torch.allclose(torch.tensor([r["advantage"] for r in rows]), expected, atol=1e-4)


class PromptsOnly(HFRollout):
    """A rollout of one's own written to the first signatures: ``complete(prompts)`` and
    ``sample_completions(prompt, n)``, without each prompt's answer and record fields."""

    TAKES_RECORDS = False
    SAMPLES_COMPLETIONS = False  # (its complete() gives the greedy answer only)

    def complete(self, prompts):
        return super().complete(prompts)

    def sample_completions(self, prompt, n):
        return super().sample_completions(prompt, n)


def test_a_rollout_declaring_it_takes_prompts_only_is_evaluated_and_tried_with_prompts_only(
    cluster, tmp_path
):
    """The loop reads what a rollout's ``complete`` and ``sample_completions`` take from its declaration
    (``TAKES_RECORDS``), not from their signatures; on workers, built from objects."""
    from rlnb import launch
    from rlnb.models import build_tiny_lm

    model = str(build_tiny_lm(tmp_path / "tiny", hidden_size=32, num_layers=1, num_heads=2))
    records = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(4) for b in range(4)]
    rollout = launch(PromptsOnly, cluster, "0", model_path=model, max_new_tokens=3)
    actor = LMActor.launch(cluster, "0", model_path=model, group_size=4)
    with GRPOLoop(
        rollout=rollout, actor=actor, reward="arithmetic", prompts=records, prompts_per_step=2,
        run_dir=tmp_path / "run",
    ) as loop:  # fmt: skip
        assert loop.evaluate(2)["eval/size"] == 2
        assert len(loop.try_prompt("3+4=", "7")) == 4
        with pytest.raises(ComponentError, match=r"PromptsOnly.complete: data.eval_samples: 2 completions"):
            loop.evaluate(2, samples=2)


def test_mask_truncated_completions_trains_as_if_they_were_not_in_the_batch(tiny_lm):
    """``algorithm.mask_truncated_completions`` (TRL's; DAPO's overlong filtering): an update with the truncated
    completions masked is the update on the batch without them (the same advantages), and not the update with
    them in."""

    def trained(mask_truncated: bool, drop_rows: bool) -> list[torch.Tensor]:
        actor = LMActor(
            tiny_lm,
            group_size=4,
            seed=0,
            update_epochs=1,
            num_minibatches=1,
            mask_truncated_completions=mask_truncated,
        )
        actor.set_batch(_two_rollout_batches(tiny_lm))
        b = actor.batch
        b["truncated"] = torch.arange(len(b["rewards"])) % 3 == 1  # (as if cut at max_new_tokens)
        actor.compute_advantages()
        if drop_rows:
            keep, n = ~b["truncated"], len(b["rewards"])
            actor.batch = {k: v[keep] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == n else v
                           for k, v in b.items()}  # fmt: skip
        actor.train()
        return [p.detach().clone() for p in actor.policy.parameters()]

    masked, without, with_them = trained(True, False), trained(False, True), trained(False, False)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(masked, without))
    assert not all(torch.allclose(a, b, atol=1e-6) for a, b in zip(masked, with_them))


def test_rollout_marks_completions_cut_at_max_new_tokens(tiny_lm):
    ro = HFRollout(tiny_lm, max_new_tokens=3, seed=0)
    summary = ro.generate(["1+2=", "13+4="], ["3", "17"], n=8)
    b = ro.take_batch()
    lengths = b["response_mask"].sum(1)
    ended = (b["input_ids"] == ro.tok.eos_token_id).logical_and(b["response_mask"].bool()).any(1)
    assert torch.equal(b["truncated"], (lengths == 3) & ~ended)
    assert summary["truncated_frac"] == pytest.approx(float(b["truncated"].float().mean()))
    assert 0 < summary["truncated_frac"] < 1 or b["truncated"].all()


def test_dynamic_sampling_assembles_kept_groups_then_groups_set_aside(tiny_lm):
    """keep_groups / assemble_kept: groups with a signal first, in the order sampled, then groups set aside to
    fill the batch; batches of other widths joined as an actor joins its ranks' batches, and trainable."""
    ro = HFRollout(tiny_lm, max_new_tokens=3, seed=0)
    ro.generate(["1+2=", "13+4="], ["3", "17"], n=4)
    ro.set_rewards([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0])  # group 0 alike (aside), group 1 kept
    assert ro.keep_groups(4) == {"groups": 2, "informative": 1, "kept": 1}
    ro.generate(["7=", "111+222="], ["7", "333"], n=4)  # another prompt width
    ro.set_rewards([0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])  # group 0 kept, group 1 aside
    assert ro.keep_groups(4) == {"groups": 2, "informative": 1, "kept": 2}
    assert ro.assemble_kept(3, 4) == {"groups": 3, "informative": 2}
    b = ro.take_batch()
    assert b["prompts"] == ["13+4="] * 4 + ["7="] * 4 + ["1+2="] * 4
    assert b["rewards"].tolist() == [0.0, 1.0, 0.0, 0.0] + [0.0, 1.0, 1.0, 1.0] + [1.0] * 4
    assert b["group_index"].tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert b["input_ids"].shape[0] == 12 and b["attention_mask"].shape == b["input_ids"].shape
    decoded = [
        ro.tok.decode(ids[m.bool() & ~r.bool()])
        for ids, m, r in zip(b["input_ids"], b["attention_mask"], b["response_mask"])
    ]
    assert decoded == b["prompts"]  # each row's prompt where its mask says, after the left padding
    actor = LMActor(tiny_lm, group_size=4, seed=0, update_epochs=1, num_minibatches=1)
    actor.set_batch([b])
    assert actor.compute_advantages()["zero_advantage_frac"] == pytest.approx(4 / 12)
    assert math.isfinite(actor.train()["loss"])


def test_dynamic_sampling_starts_each_step_afresh(tiny_lm):
    """A step's first round drops what an earlier step left (had it failed between rounds)."""
    ro = HFRollout(tiny_lm, max_new_tokens=2, seed=0)
    ro.generate(["1+2="], ["3"], n=4)
    ro.set_rewards([0.0, 1.0, 0.0, 0.0])
    ro.keep_groups(4, first=True)  # ... and the step failed here
    ro.generate(["5+5="], ["10"], n=4)
    ro.set_rewards([1.0, 0.0, 0.0, 0.0])
    assert ro.keep_groups(4, first=True)["kept"] == 1
    ro.assemble_kept(1, 4)
    assert ro.take_batch()["prompts"] == ["5+5="] * 4


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_tiny_models_tokenizer_loads_as_it_was_saved(tmp_path, arch):
    """transformers 5's AutoTokenizer loads a qwen2 model's tokenizer as Qwen2Tokenizer, whose own
    pre-tokenizer dropped every space and line break of the tiny character tokenizer (a chat template's turns
    ran together: "Add.Q:5+6=A:"). Loaded by path it is the tokenizer that was saved."""
    path = build_tiny_lm(tmp_path / arch, hidden_size=32, num_layers=1, num_heads=2, arch=arch)
    _, tok = load_lm(path)
    ids = tok("a b\nc", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == "a b\nc" and len(ids) == 5
    assert (tok("1+1=")["input_ids"][0] == tok.bos_token_id) == (arch == "llama")  # Llama's habit kept


def test_the_lm_actors_settings_have_one_source_and_the_recorded_recipe_is_what_trained(
    cluster, tiny_lm, tmp_path
):
    """Objects path: ``algorithm={"max_grad_norm": 0.3}`` is the norm the actor clips to (it clipped to its own
    argument's default, 1.0, and the recipe said 0.5), and the run's ``recipe.yaml`` records it, the actor's
    ``lr`` and its model, not the schema's defaults."""
    actor = LMActor(tiny_lm, {"max_grad_norm": 0.3, "group_size": 4}, lr=5e-3, micro_batch_size=8, seed=0)
    assert actor.max_grad_norm == 0.3 and actor.describe()["actor"].lr == 5e-3
    ro = HFRollout(tiny_lm, max_new_tokens=3, seed=1)
    ro.generate(["1+1=", "2+2="], ["2", "4"], n=4)
    ro.set_rewards([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0])
    actor.set_batch([ro.take_batch()])
    metrics = actor.train()
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in actor.policy.parameters()]))
    assert metrics["grad_norm"] > 0.3 and float(clipped) == pytest.approx(0.3, rel=1e-3), metrics["grad_norm"]

    records = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(4) for b in range(4)]
    rollout = HFRollout.launch(cluster, "0", model_path=tiny_lm, max_new_tokens=3)
    remote = LMActor.launch(
        cluster, "1", model_path=tiny_lm, algorithm={"max_grad_norm": 0.3}, lr=5e-3, group_size=4
    )
    with GRPOLoop(
        rollout=rollout, actor=remote, reward="arithmetic", prompts=records, prompts_per_step=2, run_dir=tmp_path / "run"
    ) as loop:  # fmt: skip
        loop.step_once()
        assert loop.recipe.algorithm.max_grad_norm == 0.3
    recorded = load_recipe(str(tmp_path / "run" / "recipe.yaml"))
    assert recorded.algorithm.max_grad_norm == 0.3 and recorded.actor.lr == 5e-3
    assert recorded.actor.model_path == tiny_lm and recorded.actor.anneal_lr is False


def test_gradient_checkpointing_keeps_fewer_activations_and_trains_the_same(tiny_lm):
    """actor.gradient_checkpointing: the decoder layers' activations are not kept for the backward (they are
    computed again there), so far fewer bytes are saved by the update's forward; the weights after it are the same."""
    weights, saved = {}, {}
    for on in (False, True):
        actor = LMActor(
            tiny_lm, group_size=4, seed=0, micro_batch_size=8, gradient_checkpointing=on, length_buckets=1,
            share_prompt_forward=False,
        )  # fmt: skip
        actor.set_batch(_two_rollout_batches(tiny_lm))
        actor.compute_advantages()
        kept = [0]

        def pack(t, kept=kept):  # what autograd keeps from the forward for the backward (outside checkpoints)
            kept[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            actor.train()
        saved[on], weights[on] = kept[0], {k: v.clone() for k, v in actor.policy.state_dict().items()}
    assert saved[True] < 0.7 * saved[False], saved
    assert all(torch.allclose(weights[True][k], weights[False][k], atol=1e-6) for k in weights[False])


def test_a_tiny_lm_shape_other_than_the_one_the_recipe_built_at_its_path_is_refused_not_ignored(
    cluster, tmp_path
):
    """``actor.tiny_lm.*`` changed against a model an earlier run of the recipe built at ``actor.model_path``
    was silently ignored (the run trained the old shape): refused naming the key, both shapes, and what to do.
    The same shape, and a model made otherwise (``build_tiny_lm``, a release), go on as before."""
    model = tmp_path / "model"
    overrides = [*GRPO_SMALL, f"actor.model_path={model}", "actor.sft_steps=0", "runner.tensorboard=false"]
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "first"):
        pass  # (built there with the recipe's shape: hidden 64, 4 heads)
    wider = [*overrides, "actor.tiny_lm.hidden_size=128", "actor.tiny_lm.num_heads=2"]
    with pytest.raises(ConfigError, match="actor.tiny_lm") as info:
        GRPOLoop.from_recipe("grpo_arith", wider, cluster=cluster, run_dir=tmp_path / "second")
    said = str(info.value)
    assert "hidden_size=128 (the model there: 64)" in said and "num_heads=2 (the model there: 4)" in said, (
        said
    )
    assert f"actor.model_path={model}" in said and "new directory" in said, said
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "third") as loop:
        assert loop.step == 0
    other = build_tiny_lm(tmp_path / "made", hidden_size=32, num_layers=1, num_heads=2)
    made = [*GRPO_SMALL, f"actor.model_path={other}", "actor.sft_steps=0", "runner.tensorboard=false"]
    with GRPOLoop.from_recipe("grpo_arith", made, cluster=cluster, run_dir=tmp_path / "fourth") as loop:
        assert loop.step == 0
