"""A multi-turn chat workload (BENCHMARKS.md B6 (iii)): N conversations of T turns after one
shared system prompt of S tokens, each turn adding user tokens and an answer, the contexts
growing to a length L drawn per conversation. bench/make_chat_workload.py writes one; the
load client replays it (`python -m hybridgen.benchmarks.load --chat FILE`, chat_replay.py).

The file is JSON, lengths only:

    {"kind": "hybridgen-chat-workload", "version": 1, "seed": 0, "system_tokens": 2048,
     "think_s": 1.0,
     "conversations": [{"user_tokens": [1500, ...], "answer_tokens": [128, ...]}, ...]}

Turn t of a conversation sends the system prompt, every earlier turn's user tokens and the
answer the server gave to it, then its own user tokens; it asks for answer_tokens[t] new
tokens (EOS ignored). The token ids are drawn when the workload is replayed, from the seed
and the run: random ids in [vocab / 8, vocab), one system prompt shared by every
conversation of a run and distinct between runs, so runs share no prefix.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

KIND, VERSION = "hybridgen-chat-workload", 1


class WorkloadError(ValueError):
    """A chat workload file or request that cannot be used; the message names the field."""


@dataclass(frozen=True)
class Conversation:
    """One conversation's turns."""

    user_tokens: tuple[int, ...]
    """New user tokens of each turn."""
    answer_tokens: tuple[int, ...]
    """Tokens the server answers each turn with."""

    def context(self, system: int) -> int:
        """Its tokens after the last answer."""
        return system + sum(self.user_tokens) + sum(self.answer_tokens)


@dataclass(frozen=True)
class ChatWorkload:
    """What a chat run replays (module doc)."""

    system_tokens: int
    """Tokens of the system prompt every conversation starts with."""
    conversations: tuple[Conversation, ...]
    """The conversations, in the order they start."""
    think_s: float
    """Mean pause between an answer's end and the next turn (exponential); 0: none."""
    seed: int
    """Seed of the token ids and think times."""

    @property
    def turns(self) -> int:
        return sum(len(c.user_tokens) for c in self.conversations)

    @property
    def max_context(self) -> int:
        return max(c.context(self.system_tokens) for c in self.conversations)

    def token_ids(self, vocab: int, run: int) -> tuple[list[int], list[list[list[int]]]]:
        """Run `run`'s system prompt and each conversation's user tokens per turn."""
        rng = random.Random(f"{self.seed}-{run}")
        low = vocab // 8

        def draw(n: int) -> list[int]:
            return [rng.randrange(low, vocab) for _ in range(n)]

        system = draw(self.system_tokens)
        return system, [[draw(n) for n in c.user_tokens] for c in self.conversations]

    def to_json(self) -> dict[str, object]:
        return {
            "kind": KIND,
            "version": VERSION,
            "seed": self.seed,
            "system_tokens": self.system_tokens,
            "think_s": self.think_s,
            "conversations": [
                {"user_tokens": list(c.user_tokens), "answer_tokens": list(c.answer_tokens)}
                for c in self.conversations
            ],
        }


def make(
    conversations: int,
    turns: int,
    system: int,
    answer: int,
    context: tuple[int, int],
    think_s: float = 0.0,
    seed: int = 0,
) -> ChatWorkload:
    """`conversations` of `turns` turns after a `system`-token prompt, each answered with
    `answer` tokens; each conversation's final context is drawn uniformly from `context`
    (inclusive) and its user tokens are split over its turns in proportion to weights drawn
    from [0.75, 1.25]."""
    low, high = context
    if not 0 < low <= high:
        raise WorkloadError(f"context={context}: allowed 0 < low <= high")
    if system + turns * (answer + 1) > low:
        raise WorkloadError(
            f"context low {low} is below the system prompt ({system}) plus {turns} turns of "
            f"{answer} answer tokens and at least one user token"
        )
    rng = random.Random(seed)
    convs = []
    for _ in range(conversations):
        users = rng.randint(low, high) - system - turns * answer
        weights = [rng.uniform(0.75, 1.25) for _ in range(turns)]
        split = [max(1, int(users * w / sum(weights))) for w in weights]
        split[-1] += users - sum(split)  # the last turn takes the rounding
        convs.append(Conversation(tuple(split), (answer,) * turns))
    return ChatWorkload(system, tuple(convs), think_s, seed)


def load(path: Path) -> ChatWorkload:
    """Read and check a workload file; WorkloadError names what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise WorkloadError(f"{path}: not a readable JSON file ({exc})") from None
    if not isinstance(data, dict) or data.get("kind") != KIND:
        raise WorkloadError(f"{path}: kind is not {KIND!r} (write one with make_chat_workload)")
    if data.get("version") != VERSION:
        raise WorkloadError(f"{path}: version {data.get('version')!r}, this reads {VERSION}")
    try:
        convs = tuple(
            Conversation(tuple(map(int, c["user_tokens"])), tuple(map(int, c["answer_tokens"])))
            for c in data["conversations"]
        )
        system, think, seed = int(data["system_tokens"]), float(data["think_s"]), data["seed"]
        w = ChatWorkload(system, convs, think, int(seed))
    except (KeyError, TypeError, ValueError) as exc:
        raise WorkloadError(f"{path}: a field is missing or malformed ({exc!r})") from None
    for i, c in enumerate(w.conversations):
        if not c.user_tokens or len(c.user_tokens) != len(c.answer_tokens):
            raise WorkloadError(f"{path}: conversations[{i}] needs as many answers as turns")
        if min(c.user_tokens) < 1 or min(c.answer_tokens) < 1:
            raise WorkloadError(f"{path}: conversations[{i}]: token counts must be >= 1")
    if not w.conversations or w.system_tokens < 0 or w.think_s < 0:
        raise WorkloadError(f"{path}: needs conversations, system_tokens >= 0, think_s >= 0")
    return w


def dump(workload: ChatWorkload, path: Path) -> None:
    Path(path).write_text(json.dumps(workload.to_json()) + "\n")
