"""The `openai` Python package (pinned in xtask: openai==3.51.0) against tlt-serve's OpenAI endpoints.

Usage: python3 check_openai_client.py BASE_URL MODEL

Every answer is read by the client's own types, and each raw JSON object is compared field by field with the
client's pydantic model of it: no field the model does not know, every required one present. Prints one line per
check and exits non-zero on the first failure.
"""

import sys

import openai
from openai.types import Completion, CompletionChoice, CompletionUsage
from openai.types.completion_choice import Logprobs


def fields_match(raw, model, where):
    """The raw object's keys are fields of `model`, and its required fields are present."""
    known = set(model.model_fields)
    unknown = set(raw) - known
    required = {k for k, f in model.model_fields.items() if f.is_required()}
    missing = required - set(raw)
    if unknown or missing:
        raise SystemExit(f"{where}: fields unknown to openai's {model.__name__}: {sorted(unknown)}; missing: {sorted(missing)}")
    print(f"ok {where}: {sorted(raw)} are {model.__name__}'s fields")


def main():
    base_url, model = sys.argv[1], sys.argv[2]
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
    models = client.models.list()
    assert [m.id for m in models.data] == [model], models
    print(f"ok models.list: {[m.id for m in models.data]}")

    raw = client.completions.with_raw_response.create(
        model=model, prompt="What is 1 - 1?", max_tokens=8, temperature=0, logprobs=1
    )
    body = raw.http_response.json()
    c = raw.parse()
    assert isinstance(c, Completion), type(c)
    Completion.model_validate(body)
    fields_match(body, Completion, "completion")
    fields_match(body["choices"][0], CompletionChoice, "choices[0]")
    fields_match(body["choices"][0]["logprobs"], Logprobs, "choices[0].logprobs")
    fields_match(body["usage"], CompletionUsage, "usage")
    choice = c.choices[0]
    assert isinstance(choice.text, str)
    assert choice.finish_reason in ("stop", "length"), choice.finish_reason
    lps = choice.logprobs.token_logprobs
    assert len(lps) == c.usage.completion_tokens == len(choice.logprobs.tokens), c
    assert all(lp <= 0 for lp in lps), lps
    assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens, c.usage
    print(f"ok completion: {c.usage.completion_tokens} tokens, finish {choice.finish_reason}, text {choice.text!r}")

    again = client.completions.create(model=model, prompt="What is 1 - 1?", max_tokens=8, temperature=0)
    assert again.choices[0].text == choice.text, (again.choices[0].text, choice.text)
    ids = client.completions.create(model=model, prompt=[87, 104, 97, 116], max_tokens=4, temperature=0.7, seed=3)
    assert ids.usage.prompt_tokens == 4, ids.usage
    print("ok greedy completions repeat; a token-id prompt is served")

    try:
        client.completions.create(model=model, prompt="x", max_tokens=4, temperature=-1)
        raise SystemExit("a negative temperature was accepted")
    except openai.BadRequestError as e:
        assert e.status_code == 400 and "temperature" in str(e), e
        print(f"ok bad request: BadRequestError {e.status_code}: {e.body}")
    print("openai client: all checks passed")


if __name__ == "__main__":
    main()
