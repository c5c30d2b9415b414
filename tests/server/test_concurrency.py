"""Many clients at once against the live server: nothing lost, truncated or mixed up between
requests that the engine batches together."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from server_helpers import SERVED_NAME

NUM_CLIENTS = 6
REQUESTS_PER_CLIENT = 4
MAX_TOKENS = 12
GREEDY = dict(model=SERVED_NAME, temperature=0.0, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})


def request_spec(client_id: int, request_id: int) -> dict:
    """Each (client, request) has its own prompt, endpoint and streaming mode."""
    number = client_id * REQUESTS_PER_CLIENT + request_id
    return {"chat": number % 2 == 0, "stream": number % 3 == 0,
            "prompt": f"Task {number}: write a function named step_{number} that returns {number * 7}."}


def ask(client, spec: dict) -> tuple[str, str, int]:
    """(text, finish_reason, completion tokens) for one request, streamed or not."""
    if spec["chat"]:
        kwargs = dict(messages=[{"role": "user", "content": spec["prompt"]}], **GREEDY)
        if spec["stream"]:
            chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                         **kwargs))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            return text, finish[-1], chunks[-1].usage.completion_tokens
        out = client.chat.completions.create(**kwargs)
        return out.choices[0].message.content, out.choices[0].finish_reason, out.usage.completion_tokens
    kwargs = dict(prompt=spec["prompt"], **GREEDY)
    if spec["stream"]:
        chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        return text, finish[-1], chunks[-1].usage.completion_tokens
    out = client.completions.create(**kwargs)
    return out.choices[0].text, out.choices[0].finish_reason, out.usage.completion_tokens


def test_concurrent_clients_get_their_own_complete_answers(client, engine):
    specs = {(c, r): request_spec(c, r) for c in range(NUM_CLIENTS) for r in range(REQUESTS_PER_CLIENT)}
    # Each prompt alone first (the engine then holds one sequence at a time): the reference answers.
    alone = {key: ask(client, {**spec, "stream": False}) for key, spec in specs.items()}
    assert len({text for text, _, _ in alone.values()}) == len(specs)  # distinct, so a mix-up would show

    def one_client(client_id: int) -> dict:
        return {(client_id, r): ask(client, specs[(client_id, r)]) for r in range(REQUESTS_PER_CLIENT)}

    with ThreadPoolExecutor(NUM_CLIENTS) as pool:
        futures = [pool.submit(one_client, c) for c in range(NUM_CLIENTS)]
        together = {}
        for future in futures:
            together.update(future.result(timeout=300))  # any client's error is raised here

    assert together.keys() == specs.keys()
    for key in specs:
        text, finish, num_tokens = together[key]
        assert (finish, num_tokens) == ("length", MAX_TOKENS), key  # nothing cut short
        assert text == alone[key][0], key
    load = engine.load_stats()
    assert load["running"] == 0 and load["waiting"] == 0 and load["kv_blocks_used"] == 0  # nothing leaked
