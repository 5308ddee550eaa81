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
from openai.types.chat import ChatCompletion, ChatCompletionMessage, ChatCompletionTokenLogprob
from openai.types.chat.chat_completion import Choice as ChatChoice, ChoiceLogprobs

# The conversation of the chat checks, and its rendering by the ChatML template that the test writes into the
# checkpoint's tokenizer_config.json (as transformers' apply_chat_template renders it).
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1 - 1?"}]
RENDERED = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 1 - 1?<|im_end|>\n<|im_start|>assistant\n"


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

    check_chat(client, model)

    try:
        client.completions.create(model=model, prompt="x", max_tokens=4, temperature=-1)
        raise SystemExit("a negative temperature was accepted")
    except openai.BadRequestError as e:
        assert e.status_code == 400 and "temperature" in str(e), e
        print(f"ok bad request: BadRequestError {e.status_code}: {e.body}")
    print("openai client: all checks passed")


def check_chat(client, model):
    """`chat.completions.create` read by the client's types, field by field; the same tokens as the completion of
    the rendered conversation; what is not served refused by name."""
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, top_logprobs=0
    )
    body = raw.http_response.json()
    chat = raw.parse()
    assert isinstance(chat, ChatCompletion), type(chat)
    ChatCompletion.model_validate(body)
    fields_match(body, ChatCompletion, "chat completion")
    fields_match(body["choices"][0], ChatChoice, "chat choices[0]")
    fields_match(body["choices"][0]["message"], ChatCompletionMessage, "chat choices[0].message")
    fields_match(body["choices"][0]["logprobs"], ChoiceLogprobs, "chat choices[0].logprobs")
    entries = body["choices"][0]["logprobs"]["content"]
    fields_match(entries[0], ChatCompletionTokenLogprob, "chat choices[0].logprobs.content[0]")
    assert all(set(e) == set(entries[0]) for e in entries), entries
    fields_match(body["usage"], CompletionUsage, "chat usage")
    choice = chat.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str), choice.message
    assert choice.finish_reason in ("stop", "length"), choice.finish_reason
    lps = choice.logprobs.content
    assert len(lps) == chat.usage.completion_tokens, chat
    assert all(lp.logprob <= 0 and lp.top_logprobs == [] and lp.bytes == list(lp.token.encode()) for lp in lps), lps
    print(f"ok chat completion: {chat.usage.completion_tokens} tokens, finish {choice.finish_reason}, "
          f"content {choice.message.content!r}")

    plain = client.completions.create(model=model, prompt=RENDERED, max_tokens=8, temperature=0, logprobs=1)
    assert plain.choices[0].text == choice.message.content, (plain.choices[0].text, choice.message.content)
    assert plain.usage == chat.usage, (plain.usage, chat.usage)
    assert plain.choices[0].logprobs.token_logprobs == [lp.logprob for lp in lps]
    print("ok chat completion = completion of the ChatML rendering (text, usage, log-probs)")

    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in MESSAGES]
    again = client.chat.completions.create(model=model, messages=parts, max_completion_tokens=8, temperature=0, n=2)
    assert [c.message.content for c in again.choices] == [choice.message.content] * 2, again
    assert again.usage.prompt_tokens == 2 * chat.usage.prompt_tokens, again.usage
    print("ok text content parts, max_completion_tokens, n=2")

    for kwargs, param in [({"stream": True}, "stream"), ({"logprobs": True, "top_logprobs": 2}, "top_logprobs")]:
        try:
            client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, **kwargs)
            raise SystemExit(f"{kwargs} was accepted")
        except openai.BadRequestError as e:
            assert e.status_code == 400 and e.body["param"] == param, (e, e.body)
            print(f"ok refused {kwargs}: BadRequestError {e.status_code}: {e.body['message']}")


if __name__ == "__main__":
    main()
