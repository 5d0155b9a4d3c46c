"""What a pool learns each round about its gateways' freshness: their signed head statements and heads.

After each head answer, `WeightSync` asks the answering gateway for the trainer's signed head statement
(`GET /v1/models/{model}/statement`, with the entity tag of the one it holds, so most rounds cost a
304), verifies it (a trusted signature, the model it follows) and remembers the weights hash it names
(`VersionGuard`: a later manifest of that version must carry it). With several gateways and the freeze
check on, it also asks the others for their heads (no waiting). `judge` then says which gateways are
stale: one behind a version the pool has known of for longer than `stale_after_s`
(`deltamesh.mesh.pool.head_check.FreezeWatch`), and the answering one also when it serves no statement,
or an older one than `statement_max_age_s`, where one is required. Network errors here only leave a
gateway unjudged: the head and the plan are what a round needs. `check` runs these for one head
answer and flags stale gateways (logged once each); `refuse` books anything refused (one log line,
the counters, the gateway asked last) and tells `on_refusal`, which a pool's metrics count. A one-off
sync, which cannot wait `stale_after_s`, asks `behind` whether it ended below a version it knows of
(a verified statement, a gateway's head) or with a gateway flagged stale, and `flag_lagging` to put
the gateways below that version last before it tries once more.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Mapping, Sequence

import aiohttp

from deltamesh.delta import CodecError, HeadStatement, StaleStatementError, check_fresh, digest, load_statement
from deltamesh.delta.keys import Ed25519PublicKey
from deltamesh.gateway.fetch.sources import Source
from deltamesh.gateway_client import model_path, statement_url
from deltamesh.http import HttpError, request_bytes, request_json
from deltamesh.mesh.pool.head_check import FreezeWatch, GatewayBook, Refusal, Rejected, VersionGuard
from deltamesh.mesh.pool.sync_config import PoolSyncConfig

log = logging.getLogger(__name__)

Verdict = tuple[Source, str | None]
"""A gateway and why it is stale (None: it is not)."""


def valid_head(value: object) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)


class HeadWatch:
    def __init__(self, config: PoolSyncConfig, sources: Sequence[Source], trusted_keys: Sequence[Ed25519PublicKey],
                 guard: VersionGuard, book: GatewayBook,
                 on_refusal: Callable[[Refusal], None] | None = None) -> None:
        self.config = config
        self.on_refusal = on_refusal
        self.sources = sources
        self.trusted_keys = list(trusted_keys)
        self.guard = guard
        self.book = book
        self.freeze = FreezeWatch(config.stale_after_s)
        self.statement: HeadStatement | None = None
        """The newest verified statement seen at any gateway."""
        self._cache: dict[str, tuple[str, HeadStatement]] = {}
        """Per gateway URL: the entity tag and contents of the statement it served last."""

    async def check(self, session: aiohttp.ClientSession, source: Source, model: str, head: int | None,
                    held: int | None, headers: Mapping[str, str]) -> None:
        """The checks of one head answer of `source`: its statement (Rejected when refused; the caller
        books it with `refuse`), then which gateways are stale, flagged (and logged) once each."""
        statement = await self.fetch_statement(session, source, model, headers)
        others = await self.other_heads(session, source, model, headers) if self.cross_check else {}
        for gateway, stale in self.judge(source, head, statement, others, held):
            if stale is None:
                if self.book.fresh(gateway):
                    log.info("pool %s: gateway %s caught up", self.config.name, gateway.url)
            elif self.book.stale(gateway, stale):
                log.warning("pool %s: gateway %s is stale: %s; turning to another gateway", self.config.name,
                            gateway.url, stale)
                if self.on_refusal is not None:
                    self.on_refusal(Refusal("stale", gateway.url, stale))

    def known(self) -> tuple[int, str] | None:
        """The newest version the pool knows exists, and from where: a verified head statement, or the
        head of a gateway in good standing; None before any."""
        found = []
        if self.statement is not None:
            found.append((self.statement.version, "the trainer's signed head statement"))
        for source in self.sources:
            s = self.book.standing(source)
            if s.head is not None and self.book.trusted(source):
                found.append((s.head, f"gateway {source.url}'s head"))
        return max(found, key=lambda f: f[0]) if found else None

    def behind(self, held: int | None) -> str | None:
        """Why a pool holding `held` may not be at the head: a newer version known to exist, or every
        gateway flagged stale (none vouches for the head it gave); None when neither."""
        reasons = []
        known = self.known()
        if known is not None and (held is None or known[0] > held):
            reasons.append(f"v{known[0]} exists ({known[1]} names it)")
        stale = [f"gateway {url} is stale: {s['reason']}" for url, s in self.book.describe().items()
                 if s["state"] == "stale"]
        if stale and len(stale) == len(self.sources):  # no gateway in good standing vouches for the head
            reasons += stale
        return "; ".join(reasons) or None

    def flag_lagging(self, held: int | None) -> None:
        """Flag stale (logged, counted, asked last for a while) each gateway whose head is below the newest
        version known while the pool holds less: what a one-off sync does before it tries once more."""
        known = self.known()
        if known is None or (held is not None and known[0] <= held):
            return
        for source in self.sources:
            head = self.book.standing(source).head
            if head is not None and head < known[0] and self.book.stale(source, f"its head (v{head}) is below "
                                                                                f"v{known[0]} ({known[1]})"):
                log.warning("pool %s: gateway %s is stale: its head (v%d) is below v%d; turning to another gateway",
                            self.config.name, source.url, head, known[0])
                if self.on_refusal is not None:
                    self.on_refusal(Refusal("stale", source.url, f"head v{head} below v{known[0]}"))

    def refuse(self, source: Source, rejected: Rejected) -> Refusal:
        """Book a refusal of what `source` offered: one log line, the counters, and the gateway asked last."""
        refusal = Refusal(rejected.reason, source.url, rejected.offered)
        self.book.refused(source, refusal)
        log.warning("pool %s: %s; turning to another gateway", self.config.name, refusal)
        if self.on_refusal is not None:
            self.on_refusal(refusal)
        return refusal

    @property
    def cross_check(self) -> bool:
        """Whether the other gateways' heads are asked for each round."""
        return bool(self.config.stale_after_s) and len(self.sources) > 1

    async def fetch_statement(self, session: aiohttp.ClientSession, source: Source, model: str,
                              headers: Mapping[str, str]) -> HeadStatement | None:
        """The statement `source` serves for `model`, verified; None when it serves none (or could not be
        asked). Raises Rejected: "statement" for one that does not verify or is about another model,
        "equivocation" for one naming another weights hash than the pool verified for its version."""
        cached = self._cache.get(source.url)
        asked = {**headers, "If-None-Match": cached[0]} if cached is not None else dict(headers)
        try:
            raw = await request_bytes(session, "GET", statement_url(source.url, model), headers=asked,
                                      timeout_s=self.config.stall_timeout_s)
        except HttpError as e:
            if e.status == 304 and cached is not None:
                return cached[1]
            if e.status not in (0, 404) and e.status < 500:
                log.info("statement of %s at %s: %s", model, source.url, e)
            return None
        try:
            statement = load_statement(raw, self.trusted_keys, model=model)
        except CodecError as e:
            raise Rejected("statement", f"a head statement of {model} that does not verify ({e})") from None
        self.guard.check_hash(statement.version, statement.weights_hash,
                              f"a head statement of {model} v{statement.version} naming {statement.weights_hash}")
        self.guard.know(statement.version, statement.weights_hash)
        # The entity tag a gateway gives a statement is the digest of its bytes (routes_statements).
        self._cache[source.url] = (f'"{digest(raw)}"', statement)
        if self.statement is None or statement.supersedes(self.statement):
            self.statement = statement
        return statement

    async def other_heads(self, session: aiohttp.ClientSession, current: Source, model: str,
                          headers: Mapping[str, str]) -> dict[Source, int | None]:
        """The heads of every gateway but `current` that answers (briefly, at once, no waiting)."""
        others = [s for s in self.sources if s is not current]

        async def head(source: Source) -> int | None:
            answer = await request_json(session, "GET", f"{source.url}{model_path(model, 'head')}", headers=headers,
                                        timeout_s=min(self.config.stall_timeout_s, 5.0))
            value = answer.get("head") if isinstance(answer, dict) else "?"
            if not valid_head(value):
                raise HttpError(200, f"malformed head {value!r:.40}", source.url)
            return value

        answers = await asyncio.gather(*(head(s) for s in others), return_exceptions=True)
        heads = {}
        for source, answer in zip(others, answers):
            if isinstance(answer, HttpError):
                continue  # unreachable (or no model there yet): no verdict on it this round
            if isinstance(answer, BaseException):
                raise answer
            heads[source] = answer
            self.book.saw_head(source, answer)
        return heads

    def judge(self, current: Source, head: int | None, statement: HeadStatement | None,
              others: Mapping[Source, int | None], held: int | None) -> list[Verdict]:
        """Which of the gateways heard from this round are stale, and why."""
        now = time.monotonic()
        claims = [held, statement.version if statement is not None else None]
        claims += [h for s, h in [(current, head), *others.items()] if self.book.trusted(s)]
        self.freeze.update(claims, now)
        verdicts = [(current, self._freshness(statement) or self._behind(head, now))]
        verdicts += [(s, self._behind(h, now)) for s, h in others.items()]
        return verdicts

    def _freshness(self, statement: HeadStatement | None) -> str | None:
        max_age = self.config.statement_max_age_s
        if not max_age:
            return None
        if statement is None:
            return f"serves no head statement (statement_max_age_s = {max_age:g} requires one)"
        try:
            check_fresh(statement, max_age)
        except StaleStatementError as e:
            return str(e)
        return None

    def _behind(self, head: int | None, now: float) -> str | None:
        behind = self.freeze.behind(head, now)
        if behind is None:
            return None
        shown = "no version" if head is None else f"v{head}"
        return (f"its head ({shown}) has stayed below v{behind}, known elsewhere for over "
                f"{self.config.stale_after_s:g}s")
