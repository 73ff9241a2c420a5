"""SamplingParams.validate: logit_bias (OpenAI's rules: token ids, biases in [-100, 100], at most 300) and
allowed_token_ids (vLLM's: a non-empty list of token ids)."""

import re

import pytest

from pagefleet.worker.core.sampling_params import MAX_LOGIT_BIAS, SamplingParams


@pytest.mark.parametrize("bias,vocab,message", [
    ({-1: 1.0}, None, "keys must be token ids"),
    ({"5": 1.0}, None, "keys must be token ids"),
    ({50: 1.0}, 50, "keys must be token ids in [0, 50)"),
    ({3: 100.5}, None, "values must be in [-100, 100]"),
    ({3: "big"}, None, "values must be in [-100, 100]"),
    ({t: 1.0 for t in range(MAX_LOGIT_BIAS + 1)}, None, "at most 300 entries"),
])
def test_bad_logit_bias_is_refused_naming_it(bias, vocab, message):
    with pytest.raises(ValueError, match="^logit_bias .*" + re.escape(message)) as e:
        SamplingParams(logit_bias=bias).validate(vocab)
    assert e.value.param == "logit_bias"


def test_good_logit_bias_is_kept_as_a_copy():
    bias = {t: float(t % 201 - 100) for t in range(MAX_LOGIT_BIAS)}
    params = SamplingParams(logit_bias=bias).validate(49152)
    assert params.logit_bias == bias and params.logit_bias is not bias
    assert SamplingParams(logit_bias={}).validate().logit_bias is None


@pytest.mark.parametrize("allowed", [[], [-1], [3, 100], [1.5]])
def test_bad_allowed_token_ids_are_refused_naming_them(allowed):
    with pytest.raises(ValueError, match="allowed_token_ids") as e:
        SamplingParams(allowed_token_ids=allowed).validate(vocab_size=100)
    assert e.value.param == "allowed_token_ids"
