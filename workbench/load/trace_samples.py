"""Small synthetic trace files in each public format, for trying the readers and for the tests.

::

    write_sample("mooncake", "runs/traces/mooncake.jsonl", requests=240)

The files have the public traces' layout (columns, field names, units, time stamps) and
plausible shapes - bursty arrivals, long-tailed lengths, shared system prompts in Mooncake's
``hash_ids``, multi-turn ShareGPT conversations - but made-up numbers and text: they are not
the recorded data, whose licences and sizes keep them out of this repository.  Lengths are sized
for the bundled model's 1,024-token context unless ``context`` says otherwise.
"""

from __future__ import annotations

import csv
import json
import random
from datetime import datetime, timedelta
from pathlib import Path

from workbench.errors import ConfigError
from workbench.load.traces import FORMATS, MOONCAKE_BLOCK

SUFFIX = {"workbench": ".jsonl", "sharegpt": ".json", "azure": ".csv", "burstgpt": ".csv", "mooncake": ".jsonl"}


def _arrivals(rng: random.Random, n: int, rate: float) -> list[float]:
    """Bursty arrivals: a Poisson process whose rate switches between rate/2 and 2 x rate."""
    t, out, fast = 0.0, [], False
    for _ in range(n):
        if rng.random() < 0.1:
            fast = not fast
        t += rng.expovariate(rate * (2.0 if fast else 0.5))
        out.append(t)
    return out


def _length(rng: random.Random, median: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, int(rng.lognormvariate(0, 0.6) * median)))


def write_sample(format: str, path, requests: int = 240, rate: float = 20.0, context: int = 1024,
                 seed: int = 0) -> Path:
    """A synthetic trace of ``requests`` requests in ``format`` at ``path`` (see the module docstring);
    a BurstGPT file also has a few failed requests (0 response tokens), which the reader leaves out."""
    if format not in FORMATS:
        raise ConfigError(f"trace format {format!r}: one of {', '.join(FORMATS)}")
    if isinstance(requests, bool) or not isinstance(requests, int) or requests < 1:
        raise ConfigError(f"sample trace: requests {requests!r}: expected an integer >= 1")
    if not rate > 0:
        raise ConfigError(f"sample trace: rate {rate!r}: expected requests per second > 0")
    if isinstance(context, bool) or not isinstance(context, int) or context < 128:
        raise ConfigError(f"sample trace: context {context!r}: expected the model's context in tokens, >= 128")
    rng = random.Random(seed)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    times = _arrivals(rng, requests, rate)
    short, new_hi = max(8, context // 16), max(4, context // 64)
    if format == "azure":
        t0 = datetime(2023, 11, 16, 18, 15, 46)
        with open(p, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
            for t in times:
                stamp = (t0 + timedelta(seconds=t)).strftime("%Y-%m-%d %H:%M:%S.%f") + "0"
                w.writerow([stamp, _length(rng, short * 3, 4, context // 2), _length(rng, new_hi // 2, 1, new_hi)])
    elif format == "burstgpt":
        with open(p, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type"])
            for t in times:
                a, b = _length(rng, short * 2, 4, context // 2), _length(rng, new_hi // 2, 1, new_hi)
                if rng.random() < 0.03:                     # besides: a failed request, as BurstGPT records them
                    w.writerow([round(t, 3), "ChatGPT", a, 0, a, "Conversation log"])
                w.writerow([round(t, 3), rng.choice(["ChatGPT", "GPT-4"]), a, b, a + b,
                            rng.choice(["Conversation log", "API log"])])
    elif format == "mooncake":
        # blocks of 512 tokens: as many as fit the context with the new tokens, the first half shared
        block, out_hi = MOONCAKE_BLOCK, min(64, context // 16)
        most = (context - out_hi - 1) // block + 1           # blocks a prompt may span, the last one partial
        systems = [[1000 * s + k for k in range(rng.randint(1, max(1, most // 2)))] for s in range(3)]
        nxt = 10_000
        with open(p, "w") as f:
            for t in times:
                sysb = rng.choice(systems)
                extra = rng.randint(0, most - len(sysb))
                ids = sysb + list(range(nxt, nxt + extra))
                nxt += extra
                last = min(block, context - out_hi - (len(ids) - 1) * block)
                length = (len(ids) - 1) * block + rng.randint(1, last)
                f.write(json.dumps({"timestamp": int(t * 1000), "input_length": length,
                                    "output_length": _length(rng, 16, 1, out_hi), "hash_ids": ids}) + "\n")
    elif format == "workbench":
        convs: dict[str, int] = {}
        with open(p, "w") as f:
            for t in times:
                r = rng.random()
                row = {"at": round(t, 4)}
                if r < 0.4:
                    c = f"c{rng.randint(0, max(1, requests // 8))}"
                    convs[c] = convs.get(c, short) + rng.randint(8, short)
                    row.update(prompt_tokens=min(convs[c], context // 2), max_tokens=_length(rng, 8, 1, new_hi),
                               conversation=c, priority=1)
                elif r < 0.7:
                    row.update(prompt_tokens=_length(rng, short * 2, 40, context // 2),
                               max_tokens=_length(rng, 8, 1, new_hi), prefix=f"sys{rng.randint(0, 2)}",
                               prefix_tokens=32)
                elif r < 0.8:
                    text = "Explain what a Python list comprehension is, with an example "
                    row.update(prompt=text * rng.randint(1, 3), max_tokens=_length(rng, 8, 1, new_hi))
                else:
                    row.update(prompt_tokens=_length(rng, short, 4, context // 2),
                               max_tokens=_length(rng, 8, 1, new_hi))
                f.write(json.dumps(row) + "\n")
    else:                                                   # sharegpt: conversations until `requests` user turns
        from workbench.data import heldout_prompts

        texts = heldout_prompts(64, chars=160, seed=seed)
        convs, turns = [], 0
        while turns < requests:
            k = min(rng.randint(1, 4), requests - turns)
            msgs = []
            for _ in range(k):
                msgs += [{"from": "human", "value": rng.choice(texts)[:rng.randint(20, 160)]},
                         {"from": "gpt", "value": rng.choice(texts)[:rng.randint(8, 60)]}]
            convs.append({"id": f"s{len(convs)}", "conversations": msgs})
            turns += k
        with open(p, "w") as f:
            f.write("[\n" + ",\n".join(json.dumps(c) for c in convs) + "\n]\n")
    return p
