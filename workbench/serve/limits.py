"""How much one request may ask of the server: its work is bounded before it reaches the engine,
its reply while it is built.

A request that is small on the wire can be large in work: two 1,000-token prompts with ``n`` 16,
``echo`` and ``logprobs`` 20 are 8 KB, and ask for 32 sequences of 1,000 prompt tokens and
672,672 log-probability entries (a 19.4 MB reply).  Every number that grows a request's cost is
therefore counted from the checked prompts (:class:`~workbench.serve.completion.PromptPlan`)
and refused with a 400 in OpenAI's shape that names the limit, its flag and the figure:

* **tokens** - prompt tokens x ``n`` plus ``max_tokens`` x ``n``, summed over the prompts: the
  tokens the engine holds KV for and computes or generates (``--max-request-tokens``; default
  16 x the model's context, so that any one prompt with ``n`` up to 16 fits);
* **log-probability entries** - with ``logprobs``: (echoed prompt tokens + ``max_tokens``) x ``n``
  x (top-k + 1), summed over the prompts: the entries the reply carries
  (``--max-logprob-entries``, default 65,536: lm-eval's loglikelihood batches of 16 prompts of
  1,024 tokens with ``logprobs: 1`` need 32,768);
* **reply bytes** - the reply as it is built (a whole JSON body before it is sent; a stream's
  bytes as they go): over ``--max-reply-bytes`` (default 32 MiB) the whole reply is a 400
  naming the figure, a stream ends with an error event and its choices are aborted.

Prompt-logprob work itself runs in the engine's prefill chunks (``max_num_batched_tokens`` per
step, shared with other requests), and the samples of a prompt share its prompt logprobs
(:mod:`workbench.engine.forks`), so a request within these limits holds the engine for its
steps, not for n times its prompt.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from workbench.serve import protocol as P

if TYPE_CHECKING:
    from workbench.serve.completion import PromptPlan
    from workbench.serve.requests import CompletionRequest

REQUEST_TOKENS_PER_CONTEXT = 16     # default --max-request-tokens: this many contexts
MAX_LOGPROB_ENTRIES = 1 << 16       # default --max-logprob-entries
MAX_REPLY_BYTES = 32 << 20          # default --max-reply-bytes


def request_tokens(req: CompletionRequest, plans: list[PromptPlan]) -> int:
    """Prompt tokens x n plus max_tokens x n, over the request's prompts."""
    return sum((len(p.ids) + p.max_tokens) * req.n for p in plans)


def logprob_entries(req: CompletionRequest, plans: list[PromptPlan]) -> int:
    """Log-probability entries the reply carries (0 without ``logprobs``): per choice, one per
    echoed prompt token and per generated token, each with its top-k."""
    if req.logprobs is None:
        return 0
    per_token = req.logprobs + 1
    return sum(((len(p.ids) if req.echo else 0) + p.max_tokens) * req.n * per_token for p in plans)


def _refuse(what: str, figure: str, limit: int, flag: str, fix: str) -> P.APIError:
    return P.APIError(400, f"this request asks for {figure} {what}; this server answers at most {limit:,} in one "
                           f"request ({flag}): {fix}", None, "request_too_large")


def check_request(req: CompletionRequest, plans: list[PromptPlan], max_tokens: int, max_entries: int) -> None:
    """400 ``request_too_large`` when the request's work is over either limit (see the module)."""
    tokens = request_tokens(req, plans)
    if tokens > max_tokens:
        how = (f"{len(plans)} prompt{'s' if len(plans) > 1 else ''} x n={req.n}: "
               f"({sum(len(p.ids) for p in plans):,} prompt + {sum(p.max_tokens for p in plans):,} max_tokens) "
               f"x {req.n}")
        raise _refuse("tokens", f"{tokens:,} ({how})", max_tokens, "--max-request-tokens",
                      "send fewer prompts, a smaller n or max_tokens, or several requests")
    entries = logprob_entries(req, plans)
    if entries > max_entries:
        echoed = " (echoed prompt + max_tokens)" if req.echo else " (max_tokens)"
        raise _refuse("log-probability entries", f"{entries:,} ({req.num_choices} choices x tokens{echoed} x "
                      f"(logprobs={req.logprobs} + 1))", max_entries, "--max-logprob-entries",
                      "ask fewer top logprobs, a smaller n, or send the prompts in several requests")


def reply_too_large(nbytes: int, limit: int) -> P.APIError:
    return P.APIError(400, f"the reply is {nbytes:,} bytes or more; this server sends at most {limit:,} "
                           "(--max-reply-bytes): ask fewer logprobs, a smaller n, max_tokens or echo", None,
                      "reply_too_large")
