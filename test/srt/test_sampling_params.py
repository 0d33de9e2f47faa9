"""/generate's sampling_params as upstream SGLang's clients send them: every field of upstream's SamplingParams at its
default is accepted (null meaning the default), `sampling_seed` is `seed`, and a field we do not implement is
refused at any other value with an error naming it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sglang.srt.sampling.sampling_params import (
    STOP_REGEX_MAX_LEN, UPSTREAM_AT_DEFAULT_ONLY, SamplingParamError, SamplingParams)

# What sglang.test.few_shot_gsm8k's frontend sends with every request (its defaults), plus nulls.
UPSTREAM_DEFAULTS = {
    "max_new_tokens": 256, "stop": ["Question", "Assistant:"], "stop_token_ids": None, "stop_regex": None,
    "temperature": 0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
    "repetition_penalty": 1.0, "min_new_tokens": 0, "n": 1, "json_schema": None, "regex": None, "ebnf": None,
    "structural_tag": None, "ignore_eos": False, "skip_special_tokens": True, "spaces_between_special_tokens": True,
    "no_stop_trim": False, "custom_params": None, "stream_interval": None, "logit_bias": None, "sampling_seed": None,
}


def test_upstream_fields_at_their_defaults_are_accepted():
    params = SamplingParams.from_dict(UPSTREAM_DEFAULTS)
    assert params == SamplingParams(max_new_tokens=256, stop=["Question", "Assistant:"], temperature=0)
    assert SamplingParams.from_dict({"stop_regex": []}) == SamplingParams()
    assert SamplingParams.from_dict({"temperature": None, "max_new_tokens": None}) == SamplingParams()


@pytest.mark.parametrize("name, value", [
    ("n", 2), ("structural_tag", "{}"), ("custom_params", {"a": 1}), ("stream_interval", 4),
])
def test_unimplemented_fields_are_refused_naming_them(name, value):
    assert name in UPSTREAM_AT_DEFAULT_ONLY
    with pytest.raises(SamplingParamError, match=f"'{name}' is not supported yet") as err:
        SamplingParams.from_dict({name: value})
    assert err.value.param == name


def test_sampling_seed_is_seed():
    assert SamplingParams.from_dict({"sampling_seed": 7}).seed == 7
    assert SamplingParams.from_dict({"sampling_seed": 7, "seed": 7}).seed == 7
    with pytest.raises(SamplingParamError, match="sampling_seed"):
        SamplingParams.from_dict({"sampling_seed": 7, "seed": 8})
    with pytest.raises(ValueError, match="unknown sampling parameter.*'bogus'"):
        SamplingParams.from_dict({"bogus": 1})


def test_min_new_tokens_is_checked_and_counts_as_a_history_adjustment():
    assert SamplingParams.from_dict({"min_new_tokens": 4, "max_new_tokens": 8}).has_penalties
    assert not SamplingParams().has_penalties
    for bad in (-1, 9, 2.5, True):
        with pytest.raises(SamplingParamError, match="min_new_tokens") as err:
            SamplingParams.from_dict({"min_new_tokens": bad, "max_new_tokens": 8})
        assert err.value.param == "min_new_tokens"


def test_stop_regex_is_checked():
    assert SamplingParams.from_dict({"stop_regex": r"\d+"}).stop_regex == [r"\d+"]
    assert SamplingParams.from_dict({"stop_regex": ["a+", "b"]}).stop_regex == ["a+", "b"]
    assert SamplingParams.from_dict({"stop_regex": ""}) == SamplingParams()
    for bad, why in (("(", "valid regular expressions"), ("x*", "empty string"), (["a"] * 17, "at most 16"),
                     ([""], "non-empty"), (5, "pattern")):
        with pytest.raises(SamplingParamError, match=why) as err:
            SamplingParams.from_dict({"stop_regex": bad})
        assert err.value.param == "stop_regex"


def test_stop_regex_runs_on_a_linear_engine_and_refuses_what_it_cannot_run():
    """Stop regexes are searched by RE2 (linear time): what it cannot run (backreferences, lookaround, possessive
    or atomic groups) is refused naming the field, as is a pattern over 1,000 characters or patterns too large to
    search in bounded time; the classic catastrophic-backtracking patterns are accepted."""
    for ok in (r"(a|aa)+$", r"(x+x+)+y", r"\pL+", r"(?i)answer:\s*\d+", "a" * STOP_REGEX_MAX_LEN):
        assert SamplingParams.from_dict({"stop_regex": ok}).stop_regex == [ok]
    for bad, why in ((r"(a)\1", "RE2 syntax"), (r"(?=a)b", "RE2 syntax"), (r"(?<=a)b", "RE2 syntax"),
                     (r"(?<!a)b", "RE2 syntax"), (r"(?P<x>a)(?P=x)", "RE2 syntax"), (r"a++", "RE2 syntax"),
                     (r"(?>a)b", "RE2 syntax"), ("a" * (STOP_REGEX_MAX_LEN + 1), "at most 1000 characters"),
                     (r"[\s\S]{1000}", "too large"), (r"(?:\pL{100}){10}", "too large"),
                     ([r"\pL+", r"\pN\pL"], "too large")):  # each fits; together they exceed the program budget
        with pytest.raises(SamplingParamError, match=why) as err:
            SamplingParams.from_dict({"stop_regex": bad})
        assert err.value.param == "stop_regex", bad


def test_catastrophic_stop_regexes_search_a_long_text_in_linear_time():
    """A backtracking engine takes exponential time on these (about 2**n steps for n repeated characters: (a|aa)+$
    over 28 characters already took 0.12 s); RE2 takes one pass. Run in a child process so that an engine that does
    backtrack fails the test (it never finishes) instead of hanging the suite."""
    code = """if True:
        from sglang.srt.sampling.sampling_params import compile_stop_regex, search_stop_regex
        n = 200_000
        for pattern, text in (("(a|aa)+$", "a" * n + "b"), ("(x+x+)+y", "x" * n), ("(a+)+b", "a" * n),
                              ("^(a|a?)+$", "a" * n + "b")):
            assert search_stop_regex(compile_stop_regex(pattern), text, floor=n) is None, pattern
        print("searched")
    """
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "searched" in done.stdout, done.stderr[-2000:]


def test_logit_bias_and_spaces_between_special_tokens():
    params = SamplingParams.from_dict({"logit_bias": {"5": 1.5, 7: -100}, "spaces_between_special_tokens": False})
    assert params.logit_bias == {5: 1.5, 7: -100.0} and params.adjusts_logits and not params.has_penalties
    assert params.spaces_between_special_tokens is False
    for bad in ({"x": 1}, {"5": 101}, {"5": float("nan")}, [5], {"-1": 1}):
        with pytest.raises(SamplingParamError, match="logit_bias") as err:
            SamplingParams.from_dict({"logit_bias": bad})
        assert err.value.param == "logit_bias"
    with pytest.raises(SamplingParamError, match="spaces_between_special_tokens"):
        SamplingParams.from_dict({"spaces_between_special_tokens": "no"})


def test_choice_seeds_stay_in_range_and_do_not_repeat_across_neighbouring_seeds():
    """Choice 0 keeps the request's seed; the other choices' seeds are distinct from every small seed's choices and
    within the signed 64-bit range (the old seed + c made seed S's choice 1 seed S + 1's choice 0)."""
    from sglang.srt.entrypoints.openai.serving_base import choice_seed

    seeds = {(s, c): choice_seed(s, c) for s in range(-50, 50) for c in range(16)}
    assert all(choice_seed(s, 0) == s for s in range(-50, 50))
    assert len(set(seeds.values())) == len(seeds)
    for s in (-2**63, 2**63 - 1):
        assert all(-2**63 <= choice_seed(s, c) < 2**63 for c in range(16))
