"""Algorithm library: exact values against hand-computed references, and properties."""

import logging
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlnb.algorithms import (
    aggregate,
    get_advantage,
    get_policy_loss,
    get_reward,
    kl_penalty,
    register_advantage,
    register_reward,
    value_loss,
)
from rlnb.errors import ConfigError, UnknownNameError

T = torch.tensor


def close(a, b, tol=1e-5):
    return torch.allclose(
        torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol
    )


# ------------------------------------------------------------------ advantages
def test_gae_hand_computed():
    # gamma=0.9, lambda=0.8; episode ends at t=1 (dones[1]=1), so t=1 does not bootstrap from V(s2)
    # t=2: delta = 1 + 0.9*0.2 - 0.3 = 0.88                  A2 = 0.88
    # t=1: delta = 1 + 0 - 0.4 = 0.6                          A1 = 0.6
    # t=0: delta = 1 + 0.9*0.4 - 0.5 = 0.86                   A0 = 0.86 + 0.9*0.8*0.6 = 1.292
    adv, ret = get_advantage("gae")(
        rewards=T([[1.0], [1.0], [1.0]]),
        values=T([[0.5], [0.4], [0.3]]),
        dones=T([[0.0], [1.0], [0.0]]),
        last_values=T([0.2]),
        gamma=0.9,
        gae_lambda=0.8,
    )
    assert close(adv, [[1.292], [0.6], [0.88]])
    assert close(ret, [[1.792], [1.0], [1.18]])


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.integers(1, 3), st.floats(0.5, 0.999), st.integers(0, 2**31 - 1))
def test_gae_lambda_one_is_discounted_return_minus_value(t_len, n, gamma, seed):
    g = torch.Generator().manual_seed(seed)
    rewards, values = torch.randn(t_len, n, generator=g), torch.randn(t_len, n, generator=g)
    dones = (torch.rand(t_len, n, generator=g) < 0.3).float()
    last = torch.randn(n, generator=g)
    adv, ret = get_advantage("gae")(
        rewards=rewards, values=values, dones=dones, last_values=last, gamma=gamma, gae_lambda=1.0
    )
    expected_ret = torch.zeros(t_len, n)
    running = last.clone()
    for t in reversed(range(t_len)):
        running = rewards[t] + gamma * running * (1 - dones[t])
        expected_ret[t] = running
    assert close(ret, expected_ret, 1e-4)
    assert close(adv, expected_ret - values, 1e-4)


def test_gae_on_numpy_rows_is_the_step_by_step_torch_recursion_bit_for_bit():
    """GAE's CPU path runs its recursion over numpy rows; it gives torch's step-by-step result exactly, keeps
    gradients where the inputs have them, and takes empty and one-step rollouts."""

    def reference(rewards, values, dones, last_values, gamma, gae_lambda):
        nonterminal, steps = 1.0 - dones.float(), rewards.shape[0]
        advantages = torch.zeros_like(rewards, dtype=torch.float32)
        next_adv = torch.zeros_like(last_values, dtype=torch.float32)
        for t in reversed(range(steps)):
            next_value = last_values if t == steps - 1 else values[t + 1]
            delta = rewards[t] + gamma * next_value * nonterminal[t] - values[t]
            next_adv = delta + gamma * gae_lambda * nonterminal[t] * next_adv
            advantages[t] = next_adv
        return advantages, advantages + values

    gae = get_advantage("gae")
    g = torch.Generator().manual_seed(0)
    for steps, n in ((32, 8), (1, 3), (0, 4), (128, 64)):
        r, v = torch.randn(steps, n, generator=g), torch.randn(steps, n, generator=g)
        d, last = (torch.rand(steps, n, generator=g) < 0.1).float(), torch.randn(n, generator=g)
        got, want = gae(r, v, d, last, 0.98, 0.8), reference(r, v, d, last, 0.98, 0.8)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), steps
    grads = []
    for fn in (gae, reference):  # values with a gradient: the torch recursion, the gradient kept
        v = torch.randn(5, 2, generator=torch.Generator().manual_seed(1), requires_grad=True)
        fn(torch.ones(5, 2), v, torch.zeros(5, 2), torch.zeros(2), 0.9, 0.9)[0].pow(2).sum().backward()
        grads.append(v.grad)
    assert torch.equal(*grads) and grads[0].abs().sum() > 0


def test_grpo_hand_computed_all_scales():
    r = T([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    # group 1: mean 0.25, std = sqrt((0.75^2 + 3*0.25^2)/3) = 0.5  -> [1.5, -0.5, -0.5, -0.5]
    # group 2: mean 0.5,  std = sqrt(4*0.25/3) = 0.57735          -> +-0.8660
    adv, ret = get_advantage("GRPO")(rewards=r, group_size=4, eps=0.0)
    assert close(adv, [1.5, -0.5, -0.5, -0.5, 0.866025, 0.866025, -0.866025, -0.866025])
    assert torch.equal(ret, r)
    # batch std: mean 0.375, sum sq = 3*0.625^2 + 5*0.375^2 = 1.875, /7 -> std 0.517549
    adv_b, _ = get_advantage("grpo")(rewards=r, group_size=4, scale="batch", eps=0.0)
    assert close(adv_b[:4], T([0.75, -0.25, -0.25, -0.25]) / 0.517549)
    adv_n, _ = get_advantage("grpo")(rewards=r, group_size=4, scale="none")  # Dr. GRPO
    assert close(adv_n, [0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5])
    # token level: broadcast over the response mask
    mask = T([[1, 1, 0]] * 8)
    adv_t, ret_t = get_advantage("grpo")(rewards=r, group_size=4, scale="none", response_mask=mask)
    assert adv_t.shape == (8, 3) and close(adv_t[0], [0.75, 0.75, 0.0]) and close(ret_t[0], [1.0, 1.0, 0.0])


@settings(max_examples=40, deadline=None)
@given(
    st.integers(2, 8),
    st.integers(1, 5),
    st.sampled_from(["group", "batch", "none"]),
    st.integers(0, 2**31 - 1),
)
def test_grpo_advantages_have_zero_mean_per_group(group_size, groups, scale, seed):
    r = torch.rand(group_size * groups, generator=torch.Generator().manual_seed(seed))
    adv, _ = get_advantage("grpo")(rewards=r, group_size=group_size, scale=scale)
    assert torch.allclose(adv.view(groups, group_size).mean(dim=1), torch.zeros(groups), atol=1e-4)


def test_rloo_hand_computed():
    # group [1, 0, 0, 0]: baseline_i = (sum - r_i)/3 -> [0, 1/3, 1/3, 1/3]
    adv, _ = get_advantage("rloo")(rewards=T([1.0, 0.0, 0.0, 0.0, 2.0, 4.0, 0.0, 0.0]), group_size=4)
    # group [2, 4, 0, 0]: baselines [4/3, 2/3, 2, 2] -> [2/3, 10/3, -2, -2]
    assert close(adv, [1.0, -1 / 3, -1 / 3, -1 / 3, 2 / 3, 10 / 3, -2.0, -2.0])
    with pytest.raises(ConfigError, match="rloo needs at least 2"):
        get_advantage("rloo")(rewards=T([1.0]), group_size=1)


def test_reinforce_pp_hand_computed():
    # rewards [1, 0]; mask rows of 2 and 3 tokens; gamma 1, no KL -> token returns [[1,1,0],[0,0,0]]
    # whiten over the 5 counted tokens: mean 0.4, var = (2*0.36 + 3*0.16)/4 = 0.3, std 0.547723
    mask = T([[1, 1, 0], [1, 1, 1]])
    adv, ret = get_advantage("reinforce_pp")(rewards=T([1.0, 0.0]), response_mask=mask)
    assert close(ret, [[1, 1, 0], [0, 0, 0]])
    a, b = 0.6 / 0.547723, -0.4 / 0.547723
    assert close(adv, [[a, a, 0.0], [b, b, b]], 1e-4)
    # per-token KL penalty: row 0 token rewards = [-0.1, -0.2 + 1, 0] -> returns [0.7, 0.8, 0]
    _, ret_kl = get_advantage("reinforce_pp")(
        rewards=T([1.0, 0.0]), response_mask=mask, kl=T([[0.1, 0.2, 0.0], [0.0, 0.0, 0.0]]), kl_coef=1.0
    )
    assert close(ret_kl[0], [0.7, 0.8, 0.0])
    # sequence level: whiten the rewards
    adv_s, _ = get_advantage("reinforce_pp")(rewards=T([1.0, 3.0]))
    assert close(adv_s, [-1 / math.sqrt(2), 1 / math.sqrt(2)])


def test_reinforce_pp_baseline_subtracts_group_mean():
    # groups [1, 0] and [1, 1]: centred [0.5, -0.5, 0, 0]; whitened: mean 0, std sqrt(0.5/3)
    adv, _ = get_advantage("reinforce_pp_baseline")(rewards=T([1.0, 0.0, 1.0, 1.0]), group_size=2)
    s = math.sqrt(0.5 / 3)
    assert close(adv, [0.5 / s, -0.5 / s, 0.0, 0.0], 1e-4)


def test_advantage_shape_errors_name_the_argument():
    with pytest.raises(ConfigError, match="group_size: 3 does not divide the batch of 8 rewards"):
        get_advantage("grpo")(rewards=torch.zeros(8), group_size=3)
    with pytest.raises(ConfigError, match=r"rewards: expected shape \[B\], got \(2, 4\)"):
        get_advantage("grpo")(rewards=torch.zeros(2, 4), group_size=2)
    with pytest.raises(
        ConfigError, match=r"values: has shape \(3,\), expected \(3, 1\) like rewards; try .unsqueeze\(-1\)"
    ):
        get_advantage("gae")(
            rewards=torch.zeros(3, 1),
            values=torch.zeros(3),
            dones=torch.zeros(3, 1),
            last_values=torch.zeros(1),
        )
    with pytest.raises(ConfigError, match=r"last_values: expected shape \(2,\), got \(3,\)"):
        get_advantage("gae")(
            rewards=torch.zeros(3, 2),
            values=torch.zeros(3, 2),
            dones=torch.zeros(3, 2),
            last_values=torch.zeros(3),
        )
    with pytest.raises(
        ConfigError,
        match=r"scale: expected one of \['group', 'batch', 'none'\], got 'grup'. Did you mean 'group'",
    ):
        get_advantage("grpo")(rewards=torch.zeros(4), group_size=2, scale="grup")


# ------------------------------------------------------------------ losses
def test_ppo_hand_computed():
    # A = [1, 1, -1, -1], ratio = [1.5, 0.9, 0.5, 1.1], eps 0.2
    # tok0: max(-1.5, -1.2) = -1.2 (clipped); tok1: -0.9; tok2: max(0.5, 0.8) = 0.8 (clipped); tok3: 1.1
    # token-mean = (-1.2 - 0.9 + 0.8 + 1.1) / 4 = -0.05
    ratio = T([[1.5, 0.9, 0.5, 1.1]])
    old = torch.zeros(1, 4)
    loss, m = get_policy_loss("ppo")(
        logprobs=ratio.log(), old_logprobs=old, advantages=T([[1.0, 1.0, -1.0, -1.0]]), clip_coef=0.2
    )
    assert close(loss, -0.05)
    assert m["clip_frac"] == 0.5
    assert math.isclose(m["ratio_mean"], 1.0, abs_tol=1e-6)
    # approx_kl = mean((r - 1) - log r)
    expected_kl = sum((r - 1) - math.log(r) for r in (1.5, 0.9, 0.5, 1.1)) / 4
    assert math.isclose(m["approx_kl"], expected_kl, rel_tol=1e-5)


def test_ppo_clip_higher_and_dual_clip():
    # clip-higher: eps_low 0.2, eps_high 0.28 -> ratio 1.5 with A=1 clipped at 1.28
    loss, _ = get_policy_loss("ppo")(
        logprobs=T([[1.5]]).log(),
        old_logprobs=torch.zeros(1, 1),
        advantages=T([[1.0]]),
        clip_coef=0.2,
        clip_coef_high=0.28,
    )
    assert close(loss, -1.28)
    # dual clip c=3 with A=-1, ratio 5: standard PPO gives max(5, 1.2) = 5; dual clip caps at 3
    loss, m = get_policy_loss("ppo")(
        logprobs=T([[5.0]]).log(),
        old_logprobs=torch.zeros(1, 1),
        advantages=T([[-1.0]]),
        clip_coef=0.2,
        dual_clip=3.0,
    )
    assert close(loss, 3.0) and m["clip_frac"] == 1.0
    with pytest.raises(ConfigError, match="dual_clip: expected a constant > 1, got 0.5"):
        get_policy_loss("ppo")(
            logprobs=torch.zeros(1, 1),
            old_logprobs=torch.zeros(1, 1),
            advantages=torch.ones(1, 1),
            dual_clip=0.5,
        )


def test_aggregations_hand_computed():
    loss = T([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = T([[1, 1, 1], [1, 0, 0]])
    assert close(aggregate(loss, mask, "token-mean"), 10 / 4)  # (1+2+3+4)/4
    assert close(aggregate(loss, mask, "seq-mean-token-mean"), (2 + 4) / 2)  # per-seq means 2 and 4
    assert close(aggregate(loss, mask, "seq-mean-token-sum"), (6 + 4) / 2)
    assert close(aggregate(loss, mask, "seq-mean-token-sum-norm"), (6 / 3 + 4 / 3) / 2)  # max_len = L = 3
    assert close(aggregate(loss, mask, "seq-mean-token-sum-norm", max_len=10), (0.6 + 0.4) / 2)
    with pytest.raises(ConfigError, match="Did you mean 'token-mean'"):
        aggregate(loss, mask, "token_mean")


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_ppo_equals_minus_a_ratio_without_clipping(b, length, seed):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(b, length, generator=g)
    new = (
        old + (torch.rand(b, length, generator=g) - 0.5) * 0.2
    )  # |log ratio| < 0.1 -> ratio in (0.905, 1.106)
    adv = torch.randn(b, length, generator=g)
    loss, m = get_policy_loss("ppo")(logprobs=new, old_logprobs=old, advantages=adv, clip_coef=0.2)
    assert torch.allclose(loss, (-adv * (new - old).exp()).mean(), atol=1e-5)
    assert m["clip_frac"] == 0.0


def test_gradients_reach_only_the_logprobs():
    logp = torch.randn(2, 3, requires_grad=True)
    old = torch.randn(2, 3, requires_grad=True)
    adv = torch.randn(2, 3, requires_grad=True)
    loss, _ = get_policy_loss("ppo")(logprobs=logp, old_logprobs=old, advantages=adv)
    loss.backward()
    assert logp.grad is not None and logp.grad.abs().sum() > 0
    assert old.grad is None and adv.grad is None


def test_decoupled_ppo_hand_computed():
    # prox = behaviour for token 0 (w = 1); token 1 has w = e^1 = 2.718 > cap 2 -> masked out
    # ratio vs prox = 1 on both, A = 1 -> per-token loss -1; weighted [-1, 0]; token-mean over 2 -> -0.5
    logp = torch.zeros(1, 2)
    loss, m = get_policy_loss("decoupled_ppo")(
        logprobs=logp,
        old_logprobs=T([[0.0, -1.0]]),
        prox_logprobs=torch.zeros(1, 2),
        advantages=torch.ones(1, 2),
        mask=torch.ones(1, 2),
        behave_weight_cap=2.0,
    )
    assert close(loss, -0.5) and m["behave_masked_frac"] == 0.5
    loss, _ = get_policy_loss("decoupled_ppo")(
        logprobs=logp,
        old_logprobs=T([[0.0, -1.0]]),
        prox_logprobs=torch.zeros(1, 2),
        advantages=torch.ones(1, 2),
        behave_weight_cap=2.0,
        behave_mode="clamp",
    )
    assert close(loss, (-1 - 2) / 2)  # weights [1, min(e, 2)]


def test_gspo_hand_computed_clips_the_sequence_ratio_and_its_gradient_is_the_sequence_forms():
    # row 0: token log-ratios [0.2, 0.0, -0.1] over 3 tokens -> s = exp(0.1/3) = 1.0339; A = 1, eps [0.1, 0.02]
    #        -> clipped at 1.02: loss per token -1.02, no gradient
    # row 1: log-ratios [0.01, 0.03] (a padded third token) -> s = exp(0.02) = 1.0202 < 1.1; A = -1
    #        -> max(1.0202, 1.02) = 1.0202 (unclipped side); per-sequence mean 1.0202
    # seq-mean-token-mean: (-1.02 + 1.0202) / 2
    old = torch.zeros(2, 3)
    logp = T([[0.2, 0.0, -0.1], [0.01, 0.03, 5.0]]).requires_grad_()
    mask = T([[1, 1, 1], [1, 1, 0]])
    adv = T([[1.0] * 3, [-1.0] * 3])
    loss, m = get_policy_loss("gspo")(logprobs=logp, old_logprobs=old, advantages=adv, mask=mask,
                                      clip_coef=0.1, clip_coef_high=0.02)  # fmt: skip
    s1 = math.exp(0.02)
    assert close(loss, (-1.02 + s1) / 2, tol=1e-6)
    assert math.isclose(m["ratio_mean"], (math.exp(0.1 / 3) + s1) / 2, rel_tol=1e-6)
    assert m["clip_frac"] == pytest.approx(3 / 5)  # row 0's three tokens of the five counted
    loss.backward()
    # row 0 clipped: no gradient; row 1: d/dlogp_t of (1/2) * mean_t(s) with s = exp(mean log-ratio): s / (2 * 2)
    # on each of its two tokens (the token form's gradient equals the sequence form's), none on the padding
    assert torch.allclose(logp.grad[0], torch.zeros(3))
    assert torch.allclose(logp.grad[1], T([s1 / 4, s1 / 4, 0.0]), atol=1e-6)
    # the sequence form, differentiated directly, gives the same gradient
    x = T([0.01, 0.03]).requires_grad_()
    (0.5 * torch.exp(x.mean())).backward()
    assert torch.allclose(logp.grad[1, :2], x.grad, atol=1e-6)


def test_cispo_hand_computed_weights_every_token_by_its_clipped_ratio_without_its_gradient():
    # ratios [1.5, 0.5, 1.1], A = [1, 1, -1], bounds [1 - 1.0, 1 + 0.28] = [0, 1.28]
    # weights [1.28 (clipped), 0.5, 1.1]; per-token loss -A * w * logp, logp = log ratio (old = 0)
    ratio = T([[1.5, 0.5, 1.1]])
    logp = ratio.log().requires_grad_()
    adv = T([[1.0, 1.0, -1.0]])
    loss, m = get_policy_loss("cispo")(logprobs=logp, old_logprobs=torch.zeros(1, 3), advantages=adv,
                                       clip_coef=1.0, clip_coef_high=0.28)  # fmt: skip
    w = [1.28, 0.5, 1.1]
    expected = sum(-a * wi * math.log(r) for a, wi, r in zip((1, 1, -1), w, (1.5, 0.5, 1.1))) / 3
    assert close(loss, expected, tol=1e-6)
    assert m["clip_frac"] == pytest.approx(1 / 3)
    loss.backward()
    # no token leaves the gradient (PPO's clip would drop token 0's): d/dlogp = -A * w / 3
    assert torch.allclose(logp.grad, T([[-1.28 / 3, -0.5 / 3, 1.1 / 3]]), atol=1e-6)


def test_a_preset_fills_its_keys_and_refuses_a_recipe_that_sets_one_otherwise(tmp_path):
    from rlnb.config.loader import RecipeError, load_recipe
    from rlnb.config.presets import PRESETS

    for name, keys in PRESETS.items():
        algo = load_recipe("grpo_arith", [f"algorithm.preset={name}"]).algorithm
        assert {k: getattr(algo, k) for k in keys} == keys, name
    # given on the command line it replaces what the recipe file says (grpo_arith's own scale and agg)
    dr = load_recipe("grpo_arith", ["algorithm.preset=dr_grpo"]).algorithm
    assert (dr.scale, dr.agg) == ("none", "seq-mean-token-sum-norm")
    with pytest.raises(RecipeError, match="algorithm.scale: algorithm.preset dr_grpo sets it to 'none'"):
        load_recipe("grpo_arith", ["algorithm.preset=dr_grpo", "algorithm.scale=group"])
    # the same value set twice is fine (a run directory's recipe holds the preset and its keys)
    load_recipe("grpo_arith", ["algorithm.preset=gspo", "algorithm.clip_coef=0.0003"])
    with pytest.raises(RecipeError, match=r"algorithm.clip_coef: algorithm.preset gspo sets it to 0.0003, and the "
                                          r"recipe to 0.2"):  # fmt: skip
        load_recipe("grpo_arith", ["algorithm.preset=gspo", "algorithm.clip_coef=0.2"])
    # in the file with another value for one of its keys: the same layer, refused naming the file
    own = tmp_path / "mine.yaml"
    own.write_text(
        "family: grpo\nrollout: {backend: hf}\nalgorithm: {preset: cispo, agg: seq-mean-token-mean}\n"
    )
    with pytest.raises(RecipeError, match=r"mine.yaml(.|\n)*algorithm.agg: algorithm.preset cispo sets it"):
        load_recipe(own)
    with pytest.raises(RecipeError, match="algorithm.preset: gspo is a method for LMs"):
        load_recipe("ppo_cartpole", ["algorithm.preset=gspo"])
    with pytest.raises(RecipeError, match="algorithm.preset"):
        load_recipe("grpo_arith", ["algorithm.preset=grpo_plus"])


def test_pass_at_k_is_the_chance_that_k_samples_drawn_from_n_hold_a_correct_one():
    import itertools

    from rlnb.algorithms.estimators import ks_up_to, pass_at_k

    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(5, 3, 3) == 1.0  # (n - c < k: always one)
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)  # pass@1 is the share correct
    for n in range(1, 7):  # against every draw of k of the n samples
        for c in range(n + 1):
            samples = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                draws = list(itertools.combinations(samples, k))
                assert pass_at_k(n, c, k) == pytest.approx(sum(any(d) for d in draws) / len(draws)), (n, c, k)
    assert ks_up_to(1) == [1] and ks_up_to(8) == [1, 2, 4, 8] and ks_up_to(10) == [1, 2, 4, 8, 10]
    with pytest.raises(ValueError, match="n=4, c=5, k=2"):
        pass_at_k(4, 5, 2)


def test_mismatch_weights_hand_computed_truncate_and_mask_at_token_and_sequence_level():
    from rlnb.algorithms.correction import mismatch_weights

    # trainer - engine log-ratios: row 0 [ln 3, ln 0.25, 0] over 3 tokens, row 1 [ln 1.5, pad]
    trainer = T([[math.log(3.0), math.log(0.25), 0.0], [math.log(1.5), 0.0, 0.0]])
    engine = torch.zeros(2, 3)
    mask = T([[1, 1, 1], [1, 0, 0]])
    w, m = mismatch_weights(trainer, engine, mask, "tis", "token", cap=2.0)
    assert torch.allclose(w, T([[2.0, 0.25, 1.0], [1.5, 0.0, 0.0]]), atol=1e-6)  # 3 -> 2; padding 0
    assert m["is_clipped_frac"] == pytest.approx(1 / 4) and m["is_ratio_mean"] == pytest.approx(
        (3 + 0.25 + 1 + 1.5) / 4
    )
    w, m = mismatch_weights(trainer, engine, mask, "mis", "token", cap=2.0)  # floor 1/2: 3 and 0.25 out
    assert torch.allclose(w, T([[0.0, 0.0, 1.0], [1.5, 0.0, 0.0]]), atol=1e-6) and m["is_masked_frac"] == 0.5
    w, _ = mismatch_weights(trainer, engine, mask, "mis", "token", cap=4.0, floor=0.2)  # all within [0.2, 4]
    assert torch.allclose(w, T([[3.0, 0.25, 1.0], [1.5, 0.0, 0.0]]), atol=1e-6)
    # sequence level: row 0's ratio 3 * 0.25 * 1 = 0.75, row 1's 1.5, on each of their tokens
    w, m = mismatch_weights(trainer, engine, mask, "tis", "sequence", cap=1.2)
    assert torch.allclose(w, T([[0.75] * 3, [1.2, 0.0, 0.0]]), atol=1e-6) and m["is_clipped_frac"] == 0.25
    w, _ = mismatch_weights(trainer, engine, mask, "mis", "sequence", cap=1.2)  # [1/1.2, 1.2]: both rows out
    assert torch.allclose(w, torch.zeros(2, 3))
    # KL(engine || trainer), k3 a token: (r - 1) - ln r
    kl = sum((r - 1) - math.log(r) for r in (3.0, 0.25, 1.0, 1.5)) / 4
    assert m["is_kl"] == pytest.approx(kl, rel=1e-5)
    # engines that agree: every weight 1, nothing cut, no KL
    same = torch.randn(2, 3)
    for mode in ("tis", "mis"):
        for level in ("token", "sequence"):
            w, m = mismatch_weights(same, same.clone(), None, mode, level)
            assert torch.equal(w, torch.ones(2, 3)) and float(m["is_kl"]) == 0.0, (mode, level)


def test_token_gae_hand_computed_over_a_completions_tokens_skipping_what_is_off_the_mask():
    # one completion of 3 tokens after a prompt token, reward 1 at its end, values 0.5, 0.2, 0.1, gamma 1
    values, mask, reward = T([[0.0, 0.5, 0.2, 0.1]]), T([[0, 1, 1, 1]]), T([1.0])
    adv, ret = get_advantage("token_gae")(rewards=reward, values=values, response_mask=mask, gamma=1.0,
                                          gae_lambda=1.0)  # fmt: skip
    assert close(adv, [[0.0, 0.5, 0.8, 0.9]]) and close(ret, [[0.0, 1.0, 1.0, 1.0]])  # lambda 1: R - V
    # lambda 0.5: deltas 0.9 (last), -0.1, -0.3; A = 0.9, -0.1 + 0.45 = 0.35, -0.3 + 0.175 = -0.125
    adv, _ = get_advantage("token_gae")(
        rewards=reward, values=values, response_mask=mask, gamma=1.0, gae_lambda=0.5
    )
    assert close(adv, [[0.0, -0.125, 0.35, 0.9]])
    # a multi-turn transcript: the reply at column 2 is off the mask, its value never read
    gap = T([[0.0, 0.5, 9.0, 0.1]])
    adv, _ = get_advantage("token_gae")(rewards=reward, values=gap, response_mask=T([[0, 1, 0, 1]]), gamma=1.0,
                                        gae_lambda=0.5)  # fmt: skip
    assert close(adv, [[0.0, -0.4 + 0.45, 0.0, 0.9]])
    # gamma discounts toward the reward at the end
    adv, ret = get_advantage("token_gae")(rewards=reward, values=torch.zeros(1, 4), response_mask=mask, gamma=0.5,
                                          gae_lambda=1.0)  # fmt: skip
    assert close(ret, [[0.0, 0.25, 0.5, 1.0]])


def test_value_loss_clipped_and_unclipped():
    v, old, ret = T([2.0, 0.0]), T([1.0, 0.0]), T([3.0, 1.0])
    # unclipped: 0.5 * mean((2-3)^2, (0-1)^2) = 0.5
    assert close(value_loss(v, old, ret), 0.5)
    # clipped (0.5): v_clip = [1.5, 0]; max((2-3)^2, (1.5-3)^2) = 2.25, and 1 -> 0.5 * 3.25/2
    assert close(value_loss(v, old, ret, clip_coef=0.5), 0.5 * 3.25 / 2)


def test_actor_critic_combines_terms():
    n = 4
    logp = torch.zeros(n)
    loss, m = get_policy_loss("actor_critic")(
        logprobs=logp,
        old_logprobs=torch.zeros(n),
        advantages=T([1.0, -1.0, 1.0, -1.0]),
        values=T([1.0, 1.0, 1.0, 1.0]),
        old_values=T([1.0, 1.0, 1.0, 1.0]),
        returns=T([2.0, 2.0, 0.0, 0.0]),
        entropy=T([0.5, 0.5, 0.5, 0.5]),
        vf_coef=0.5,
        ent_coef=0.1,
        norm_adv=False,
    )
    # pg = mean(-A * 1) = 0; v = 0.5 * 1 = 0.5; loss = 0 - 0.1*0.5 + 0.5*0.5 = 0.2
    assert close(loss, 0.2) and math.isclose(m["value_loss"], 0.5) and math.isclose(m["entropy"], 0.5)


def test_kl_estimators_hand_computed():
    logp, ref = T([math.log(0.5)]), T([math.log(0.25)])
    # log_r = log(0.25/0.5) = -0.693147
    assert close(kl_penalty(logp, ref, "k1"), [0.693147])
    assert close(kl_penalty(logp, ref, "k2"), [0.5 * 0.693147**2])
    assert close(kl_penalty(logp, ref, "k3"), [0.5 - 1 + 0.693147])
    with pytest.raises(ConfigError, match="Did you mean 'k3'"):
        kl_penalty(logp, ref, "k_3")


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=1, max_size=8), st.lists(st.floats(-5, 5), min_size=1, max_size=8))
def test_k3_is_nonnegative(a, b):
    n = min(len(a), len(b))
    assert (kl_penalty(T(a[:n]), T(b[:n]), "k3") >= -1e-6).all()


# ------------------------------------------------------------------ registries
def test_register_custom_advantage_and_typo():
    @register_advantage("my_baseline", overwrite=True)
    def my_baseline(rewards, **_):
        return rewards - rewards.mean(), rewards

    adv, _ = get_advantage("My_Baseline")(rewards=T([1.0, 3.0]))
    assert close(adv, [-1.0, 1.0])
    with pytest.raises(UnknownNameError) as e:
        get_advantage("gea")
    msg = str(e.value)
    assert (
        "unknown advantage 'gea'; registered:" in msg and "gae, grpo" in msg and "Did you mean 'gae'?" in msg
    )
    assert e.value.key == "algorithm.advantage"
    with pytest.raises(UnknownNameError, match="Did you mean 'ppo'"):
        get_policy_loss("ppp")
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("gae")(lambda **k: None)


# ------------------------------------------------------------------ rewards
@pytest.mark.parametrize(
    "completion,answer,expected",
    [
        ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{1/2}", "\\frac{1}{2}", 1.0),
        ("the value is 0.5", "1/2", 1.0),
        ("we get #### 1+2x", "2x+1", 1.0),
        ("total: 1,000 apples", "1000", 1.0),
        ("\\boxed{1000}", "#### 1,000", 1.0),
        ("Natalia sold 48 + 24 = 72 clips. #### 72", "72", 1.0),
        ("it is 7", "8", 0.0),
        ("no number here", "3", 0.0),
        ("\\boxed{x^2}", "x^2", 1.0),
    ],
)
def test_math_reward(completion, answer, expected):
    assert get_reward("math")(completion, answer) == expected


def test_arithmetic_and_format_rewards():
    arith = get_reward("arithmetic")
    assert arith("19", "19") == 1.0 and arith(" 19 then", "19") == 1.0
    assert arith("18", "19") == 0.0 and arith("x19", "19") == 0.0 and arith("-3", "-3") == 1.0
    fmt = get_reward("format")
    assert fmt("so \\boxed{3}", "3") == 1.0 and fmt("#### 3", "3") == 1.0 and fmt("3", "3") == 0.0
    assert get_reward("format", pattern=r"^\d+$")("42", "") == 1.0


def test_raising_reward_scores_zero_and_logs_once(caplog):
    @register_reward("explodes", overwrite=True)
    def explodes(completion, answer):
        raise ZeroDivisionError("nope")

    r = get_reward("explodes")
    with caplog.at_level(logging.WARNING, logger="rlnb.rewards"):
        assert r("a", "b") == 0.0
        assert r("c", "d") == 0.0
    assert len([rec for rec in caplog.records if "explodes" in rec.getMessage()]) == 1
    with pytest.raises(UnknownNameError, match="Did you mean 'math'"):
        get_reward("mth")


def test_cleanrl_style_ppo_equals_the_composed_losses():
    """The embodied loss, written out as CleanRL does, equals the general clipped surrogate plus the value
    loss minus the entropy bonus (random minibatch, clipping active, clipped value loss)."""
    from rlnb.algorithms.losses import entropy_bonus, ppo

    g = torch.Generator().manual_seed(0)
    m = 64
    logp, old = torch.randn(m, generator=g) * 0.3, torch.randn(m, generator=g) * 0.3
    adv, values, old_values, returns = (torch.randn(m, generator=g) for _ in range(4))
    entropy = torch.rand(m, generator=g)
    loss, metrics = get_policy_loss("ppo_clip_value_entropy")(
        logprobs=logp, old_logprobs=old, advantages=adv, values=values, old_values=old_values,
        returns=returns, entropy=entropy, clip_coef=0.2, vf_coef=0.5, ent_coef=0.01, clip_vloss=True,
    )  # fmt: skip
    norm = (adv - adv.mean()) / (adv.std() + 1e-8)
    pg, pg_metrics = ppo(logp, old, norm, clip_coef=0.2)
    expected = (
        pg + 0.5 * value_loss(values, old_values, returns, clip_coef=0.2) - 0.01 * entropy_bonus(entropy)
    )
    assert close(loss, float(expected)) and 0 < float(metrics["clip_frac"]) < 1
    assert close(metrics["approx_kl"], float(pg_metrics["approx_kl"]))


def test_tool_calls_run_the_last_tool_the_model_called_and_a_turn_without_one_is_final():
    from rlnb.algorithms.interactions import calculator, get_interaction, tool_calls

    calc = get_interaction("calculator")  # as the rollout calls it: by keyword, the latest turn alone
    assert calc(completion="whole transcript", turn=1, last_turn="calc(1+1) then calc(3*(4+5))") == " = 27;"
    assert calc(completion="calc(1+1)", turn=2, last_turn="27") is None  # no call in the latest turn: final
    assert calc(completion="", turn=1, last_turn="calc(7/2)") == " = 3.5;"
    assert calc(completion="", turn=1, last_turn="calc(1/0)") == " = error: ZeroDivisionError;"
    for unsafe in ("__import__('os')", "2**99999", "x+1", "[1][0]", "1" * 201):
        assert calc(completion="", turn=1, last_turn=f"calc({unsafe})") == " = error: ValueError;", unsafe
    assert calculator("-(2 + 3) * 4 // 3 % 5") == (-(2 + 3) * 4 // 3) % 5
    lookup = tool_calls({"upper": str.upper, "count": len}, result="\n<{result}>\n")
    assert lookup(last_turn="upper(abc) count(hello)") == "\n<5>\n" and lookup(last_turn="counted(x)") is None
    for bad in ({}, {"not a name": len}, {1: len}):
        with pytest.raises(ConfigError, match="tools: expected"):
            tool_calls(bad)
