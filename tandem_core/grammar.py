"""Structured outputs: from a request's grammar spec (tandem_core.types.GenerationRequest.grammar)
to the allowed-token bitmask each sampler applies before it draws a token.

Why llguidance: its masks take microseconds per step (measured ~3-6 us for a small JSON schema on
the built-in 2048-token vocabulary; an Earley parser over a token trie with lexer-level slicing, so
large vocabularies stay cheap too), it is correct on the token/byte boundary (tokens that span
several lexemes, partial UTF-8), it compiles JSON Schema, regexes, choices and Lark with `%json`
from one code path, bounds its own per-step work (lexer fuel, Earley items) and grammar size, and it
is one small Rust wheel with numpy only: no torch, no transformers (llguidance.hf imports
transformers, so the tokenizer is built here from token byte strings instead). xgrammar needs torch
for its tokenizer info; outlines-core compiles a whole-vocabulary index per schema (seconds for a
large schema, memory per schema).

JSON is compiled compact: `whitespace_flexible` off, separators "," and ":" only, so no token can
be spent on whitespace and a strict schema can always be closed; an integer without bounds gets
the safe-integer range (`bounded`: at most 16 digits); once the grammar is complete the mask
allows only EOS, so a constrained request ends with finish "stop". Strings without maxLength and
the fraction of a number stay unbounded (a schema that wants a short answer says so).

Output that ends within its budget (issue 33): the grammar alone guarantees validity only if the
model chooses to close, and a small model at temperature 1 may add optional keys or string bytes
until max_tokens. So a matcher that is told its budget (the tokens it may still emit) keeps an
estimate of the shortest way to a complete sentence, its *closing path* (`closing_path`: a greedy
walk on a copy of the matcher that takes forced tokens, else the allowed single-byte token that
most lowers a JSON nesting score: close the string, the object, the array, end the number, write
`0` for a value, stop adding optional keys). Near the end of the budget the mask keeps only the
tokens after which that path still fits: with few allowed tokens (a choice, a digit, the next
key) each is checked by its own closing path; with many, the *plain* ones (content without
structural bytes, which cannot open anything: they may only leave a UTF-8 character or a number
unfinished, PLAIN_SLACK) stay while the path has room, and those that may open structure (a
quote, a brace, a `<` that starts another call) are checked one by one once the path plus
CLOSE_WIDE reaches the budget (inside a JSON string, where they can only end it, once the path
plus CLOSE_MARGIN does). When the path fills the budget exactly, only its next token is allowed.
The output then closes in time; if the budget removed any token `closed_early` is set and the
request ends with finish "length" (vLLM's convention: the budget, not the model, ended it)
although its output parses. The path is recomputed only near the end of the budget or when the
sampled token left it. Cost, measured with a uniform sampler on the built-in vocabulary on these
shared CPUs: 0.1-0.8 ms of host time per constrained token while near the end of the budget (the
per-token checks), nothing before; that search runs outside the mask deadline.

Who calls what: the gateway calls `check_spec` to refuse a bad spec with a 400 before enqueueing;
the prefill pod and the decode pod call `compile_spec` (LRU-cached, bounded by the caller's size)
and keep one `Matcher` per request choice while its slot lives. No JAX here, no I/O.
"""
from __future__ import annotations

import json
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

import llguidance as llg
import numpy as np

from tandem_core.errors import InvalidRequest, TandemError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions
    from tandem_core.tokenizer import Tokenizer

KINDS = ("json_schema", "json_object", "regex", "choice", "lark")
MAX_SPEC_BYTES = 64 * 1024  # a schema / grammar / pattern bigger than this is refused (400)
MAX_CHOICES = 256
DEFAULT_CACHE_SIZE = 128  # compiled grammars kept per tokenizer (LRU); settings pass their own
DEFAULT_MASK_DEADLINE_S = 0.05  # one mask taking more CPU than this fails its request (llguidance's
# own fuel limits bound a step to ~15 ms of work; this catches what slips past them)
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
LIMITS: dict[str, Any] = dict(max_grammar_size=200_000, step_lexer_fuel=200_000, step_max_items=50_000,
              max_lexer_states=100_000, initial_lexer_fuel=1_000_000)


CLOSE_MARGIN = 8  # inside a JSON string, quotes are checked once the closing path + this reaches the budget
PLAIN_SLACK = 3  # what one plain token may still add to the path: an unfinished UTF-8 character, `1.`/`1e`
EXACT_CHECK_MAX = 48  # at most this many structural tokens are checked by their own closing path per step
STRUCTURAL = b'{}[]",:\\<'  # bytes that may open structure (JSON, a <tool_call>): not "plain" content
IN_STRING = b'"\\'  # inside a JSON string only these end it or escape
CLOSE_WIDE = 48  # tokens that open structure are checked once the path + this reaches the budget (a new call ~40):
# one that opens something whose smallest completion is longer (a second call of a tool with many
# required arguments) is not caught earlier, and such an output may still be cut (a known limit)
CLOSE_SLACK = 56  # while the budget exceeds the last path + margin + this, the path is not recomputed
CLOSE_RECHECK = 16  # ... except every this many tokens
MAX_CLOSE_TOKENS = 256  # a closing path longer than this is not searched for (then nothing is forced)
_PREFER = b'"}]0,:{[tfn-1.eE'  # single bytes tried when closing, in this order (ties keep the first)


class GrammarError(TandemError):
    """A constrained request cannot go on: its grammar rejected a token, or a mask failed or ran
    past its deadline. Fails that request only."""

    error_type = "grammar_error"


# ---------------------------------------------------------------------------------------------
# the llguidance tokenizer, built from a Tandem tokenizer's token bytes


class _TokenTable:
    """What llguidance.TokenizerWrapper reads: token byte strings, EOS, special ids, encode."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self._tok = tokenizer
        self.tokens = [tokenizer.token_bytes(i) for i in range(vocab_size)]  # b"": never allowed
        eos = tuple(tokenizer.eos_token_ids)
        if not eos:
            raise InvalidRequest("this model's tokenizer has no EOS token, so a grammar could never end",
                                 param="grammar")
        self.eos_token_id = int(eos[0])
        self.bos_token_id = tokenizer.bos_token_id
        # special tokens have bytes but no text (decode skips them): a grammar must never emit them
        named = {int(i) for i in (*eos, tokenizer.bos_token_id) if i is not None and 0 <= i < vocab_size}
        self.special_token_ids = sorted(named | {i for i, b in enumerate(self.tokens)
                                                 if b and tokenizer.decode([i]) == ""})

    def __call__(self, s: str | bytes) -> list[int]:
        text = s.decode("utf-8", errors="replace") if isinstance(s, bytes) else s
        return self._tok.encode(text, add_special_tokens=False)


def _vocab_size(tokenizer) -> int:
    size = getattr(tokenizer, "vocab_size", None)
    if size:
        return int(size)
    hi = 1  # token ids are contiguous: grow past the last id that has bytes, then bisect
    while tokenizer.token_bytes(hi):
        hi *= 2
    lo = hi // 2
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if tokenizer.token_bytes(mid) else (lo, mid)
    return hi


_lltokenizers: "weakref.WeakKeyDictionary[Any, dict[int, llg.LLTokenizer]]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def ll_tokenizer(tokenizer, vocab_size: int | None = None) -> llg.LLTokenizer:
    """The llguidance tokenizer of a Tandem tokenizer (cached per tokenizer and vocab size).
    `vocab_size`: the model's (the mask width); default the tokenizer's own."""
    n = int(vocab_size or _vocab_size(tokenizer))
    with _lock:
        per = _lltokenizers.setdefault(tokenizer, {})
        if n not in per:
            eos = [int(t) for t in tokenizer.eos_token_ids if 0 <= int(t) < n]
            per[n] = llg.LLTokenizer(llg.TokenizerWrapper(_TokenTable(tokenizer, n)), n_vocab=n,
                                     eos_token=eos or None)
        return per[n]


# ---------------------------------------------------------------------------------------------
# spec -> llguidance grammar


def _sized(name: str, text: str) -> str:
    if len(text.encode("utf-8")) > MAX_SPEC_BYTES:
        raise InvalidRequest(f"grammar {name} is {len(text.encode('utf-8'))} bytes; at most {MAX_SPEC_BYTES} "
                             f"are allowed", param="grammar")
    return text


def _field(spec: dict, name: str, kind: type) -> Any:
    value = spec.get(name)
    if not isinstance(value, kind):
        raise InvalidRequest(f"grammar kind {spec['kind']!r} needs {name!r} as a {kind.__name__}, got "
                             f"{type(value).__name__}", param="grammar")
    return value


SAFE_INTEGER = 2**53 - 1  # I-JSON (RFC 7493): the integers every JSON reader holds exactly
_DATA_KEYS = frozenset({"const", "enum", "default", "examples"})  # JSON values, not schemas


def bounded(schema: Any) -> Any:
    """The schema with every integer that has no bound on a side bounded to the safe-integer
    range, so an integer has at most 16 digits: left unbounded, a small model at temperature 1
    writes digits until max_tokens (seen: 60 digits of an "age"). A copy; data values untouched."""
    if isinstance(schema, list):
        return [bounded(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in _DATA_KEYS else bounded(v)) for k, v in schema.items()}
    types = out.get("type")
    if types == "integer" or (isinstance(types, list) and types == ["integer"]):
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -SAFE_INTEGER
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = SAFE_INTEGER
    return out


def _choice_grammar(spec: dict) -> str:
    choices = _field(spec, "choices", list)
    if not 0 < len(choices) <= MAX_CHOICES or not all(isinstance(c, str) and c for c in choices):
        raise InvalidRequest(f"grammar choices must be 1 to {MAX_CHOICES} non-empty strings", param="grammar")
    return llg.LLMatcher.grammar_from_lark(_sized("choices", "start: " + " | ".join(json.dumps(c) for c in choices)))


def grammar_of(spec: dict) -> str:
    """The llguidance grammar (its serialized form) of a spec; InvalidRequest for a malformed one."""
    if not isinstance(spec, dict) or spec.get("kind") not in KINDS:
        kind = spec.get("kind") if isinstance(spec, dict) else type(spec).__name__
        raise InvalidRequest(f"grammar kind {kind!r} is not supported; use one of {', '.join(KINDS)}",
                             param="grammar")
    kind = spec["kind"]
    if kind == "json_schema":
        schema = spec.get("schema")
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequest("grammar json_schema needs 'schema' as a JSON object", param="grammar")
        _sized("schema", json.dumps(schema, separators=(",", ":")))
        return llg.LLMatcher.grammar_from_json_schema(json.dumps(bounded(schema)), overrides=JSON_OPTIONS)
    if kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema('{"type":"object"}', overrides=JSON_OPTIONS)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(_sized("pattern", _field(spec, "pattern", str)))
    if kind == "choice":
        return _choice_grammar(spec)
    return llg.LLMatcher.grammar_from_lark(_sized("grammar", _field(spec, "grammar", str)))


def _limits() -> llg.LLParserLimits:
    return llg.LLParserLimits(**LIMITS, verbose_errors=False)


# ---------------------------------------------------------------------------------------------
# compile (cached) and match


@dataclass(frozen=True)
class Compiled:
    """A validated grammar for one tokenizer: `matcher()` copies its pristine matcher (cheap)."""

    kind: str
    template: llg.LLMatcher  # never advanced: each Matcher starts from a deep copy of it
    tokenizer: llg.LLTokenizer
    vocab_size: int
    singles: tuple[tuple[int, int], ...] = ()  # (byte, token id) of the _PREFER bytes that are one token
    plain_out: np.ndarray | None = field(default=None, compare=False)  # uint32 bits: tokens with no STRUCTURAL byte
    plain_in: np.ndarray | None = field(default=None, compare=False)  # ... with no IN_STRING byte

    def matcher(self, tokens: Sequence[int] = (), deadline_s: float = DEFAULT_MASK_DEADLINE_S) -> "Matcher":
        return Matcher(self, tokens, deadline_s)


_cache: "OrderedDict[tuple[int, str], Compiled]" = OrderedDict()


def _spec_key(spec: dict) -> str:
    try:
        return json.dumps(spec, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise InvalidRequest(f"grammar spec is not JSON-serializable: {e}", param="grammar") from None


def _compile(spec: dict, llt: llg.LLTokenizer) -> Compiled:
    try:
        grammar = grammar_of(spec)
    except ValueError as e:  # llguidance: the schema or grammar is not valid JSON/text
        raise InvalidRequest(f"grammar {spec.get('kind')} is malformed: {e}", param="grammar") from None
    failed, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, llt, limits=_limits())
    if failed:
        raise InvalidRequest(f"grammar {spec['kind']} is not supported: {messages[0].strip()}", param="grammar")
    template = llg.LLMatcher(llt, grammar, log_level=0, limits=_limits())
    if template.is_error():
        raise InvalidRequest(f"grammar {spec['kind']} is not supported: {template.get_error()}", param="grammar")
    return Compiled(spec["kind"], template, llt, llt.vocab_size, *_token_classes(llt))


_classes: dict[int, tuple] = {}


def _token_classes(llt: llg.LLTokenizer) -> tuple:
    """Per tokenizer (cached): (byte, token id) for each byte of _PREFER that one token spells
    alone, in _PREFER's order; the bitmasks of the tokens with no STRUCTURAL byte, and with no
    IN_STRING byte."""
    with _lock:
        hit = _classes.get(id(llt))
    if hit is not None:
        return hit
    special = set(llt.eos_tokens)
    by_byte: dict[int, int] = {}
    plain = np.zeros(((llt.vocab_size + 31) // 32,), np.uint32)
    plain_in = np.zeros_like(plain)
    for t in range(llt.vocab_size):
        if t in special:
            continue
        b = llt.decode_bytes([t])
        if len(b) == 1 and b[0] in _PREFER and b[0] not in by_byte:
            by_byte[b[0]] = t
        if b and not any(c in STRUCTURAL for c in b):
            plain[t >> 5] |= np.uint32(1 << (t & 31))
        if b and not any(c in IN_STRING for c in b):
            plain_in[t >> 5] |= np.uint32(1 << (t & 31))
    out = (tuple((b, by_byte[b]) for b in _PREFER if b in by_byte), plain, plain_in)
    with _lock:
        _classes[id(llt)] = out
    return out


def compile_spec(spec: dict, tokenizer, *, vocab_size: int | None = None,
                 cache_size: int = DEFAULT_CACHE_SIZE) -> Compiled:
    """The compiled grammar of `spec` for `tokenizer` (a Tandem tokenizer), from an LRU cache of at
    most `cache_size` grammars (settings pass it). `vocab_size`: the model's, i.e. the mask width.
    InvalidRequest names what is wrong: the kind, the field, the unsupported construct, the size."""
    if cache_size < 1:
        raise ValueError(f"cache_size must be >= 1, got {cache_size}")
    llt = ll_tokenizer(tokenizer, vocab_size)
    key = (id(llt), _spec_key(spec))
    with _lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
            return hit
    compiled = _compile(spec, llt)  # outside the lock: llguidance drops the GIL while it builds
    with _lock:
        _cache[key] = compiled
        _cache.move_to_end(key)
        while len(_cache) > cache_size:
            _cache.popitem(last=False)
    return compiled


def cache_len() -> int:
    with _lock:
        return len(_cache)


def check_spec(spec: dict, tokenizer, *, vocab_size: int | None = None,
               cache_size: int = DEFAULT_CACHE_SIZE) -> None:
    """Validate only (the gateway, before enqueueing): InvalidRequest for a spec no pod could run.
    The compiled grammar is cached, so a colocated pod that serves it next pays nothing."""
    compile_spec(spec, tokenizer, vocab_size=vocab_size, cache_size=cache_size)


class Matcher:
    """One request choice's position in its grammar. `tokens`: the output so far (a resume:
    prompt_ids[output_from:], then the first token); GrammarError if they do not match.
    Owned by one thread; lives only while its slot does."""

    def __init__(self, compiled: Compiled, tokens: Sequence[int] = (),
                 deadline_s: float = DEFAULT_MASK_DEADLINE_S) -> None:
        self.compiled = compiled
        self.deadline_s = float(deadline_s)
        self.eos = compiled.tokenizer.eos_token
        self.width = (compiled.vocab_size + 31) // 32
        self._m = compiled.template.deep_copy()
        self.closed_early = False  # the budget forced the output closed (finish "length")
        self.rebuild(tokens)

    def rebuild(self, tokens: Sequence[int]) -> None:
        """Restart from the grammar's start and consume `tokens` (the output streamed so far)."""
        self._m.reset()
        self._ahead: list[_Closing] | None = None  # proposal_masks' heuristic states, position by position
        self._ahead_at = 0
        self._lex = _JsonLex()
        self._path: list[int] | None = None  # the closing path from here (None: not known)
        self._cost = 0  # the length of the last closing path computed
        self._since = CLOSE_RECHECK  # tokens consumed since it was computed (the first mask computes it)
        toks = [int(t) for t in tokens]
        if toks and not self._m.consume_tokens(toks):
            raise GrammarError(f"the {len(toks)} tokens already generated do not match the grammar "
                               f"{self.compiled.kind}: {self._m.get_error()}")
        if toks:
            self._lex.feed(self.compiled.tokenizer.decode_bytes(toks))

    def mask_into(self, row: np.ndarray, budget: int | None = None) -> None:
        """Write the allowed-token bitmask (int32 [width], bit t % 32 of word t // 32) into `row`.
        `budget`: the tokens this output may still emit, this one included (None: unbounded);
        near its end, only tokens after which the output can still close in time are allowed
        (see the module docstring)."""
        if row.dtype != np.int32 or row.shape != (self.width,) or not row.flags["C_CONTIGUOUS"]:
            raise ValueError(f"mask row must be contiguous int32 [{self.width}], got {row.dtype} {row.shape}")
        self._ahead = None  # a plain position: a verify call's states are behind it
        t0 = time.thread_time()  # CPU time of this thread: a busy host's preemption is not the grammar's
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)  # runs here, GIL dropped
        took = time.thread_time() - t0
        if self._m.is_error():
            raise GrammarError(f"grammar {self.compiled.kind} failed: {self._m.get_error()}")
        if took > self.deadline_s:
            raise GrammarError(f"grammar {self.compiled.kind} took {took * 1e3:.1f} ms for one token mask; "
                               f"the deadline is {self.deadline_s * 1e3:.0f} ms")
        if budget is not None:  # the closing search is bounded by its own limits, not by the mask deadline
            self._restrict(row.view(np.uint32), int(budget))

    def mask(self, budget: int | None = None) -> np.ndarray:
        """The allowed-token bitmask, int32 [ceil(vocab / 32)] (llguidance's packed layout)."""
        row = np.zeros((self.width,), np.int32)
        self.mask_into(row, budget)
        return row

    def consume(self, token_id: int) -> None:
        """Advance past a sampled token; GrammarError if the grammar rejects it."""
        t = int(token_id)
        if self._ahead is not None:  # a verify call's tokens: the state its mask left (proposal_masks)
            if 0 < self._ahead_at < len(self._ahead):
                self._restore(self._ahead[self._ahead_at])
            self._ahead_at += 1
        if not self._m.consume_token(t):
            raise GrammarError(f"token {t} is not allowed by the grammar {self.compiled.kind}: "
                               f"{self._m.get_error()}")
        self._lex.feed(self.compiled.tokenizer.decode_bytes([t]))
        self._since += 1
        if self._path and self._path[0] == t:
            self._path.pop(0)
            self._cost = len(self._path)
        else:
            self._path = None

    def proposal_masks(self, tokens: Sequence[int], budget: int | None, out: np.ndarray,
                       drawn: bool = False) -> int:
        """Speculative decoding (decode_svc/constrained.py): how many of `tokens`, a proposal for
        the positions after this one, a verify call may check, with out[i] (int32 [>= n + 1,
        width]) the mask of the position after the first i of them for i in 1 .. n (out[0], this
        position's, is `mask_into`'s, computed before). Every position is masked as a plain step
        would mask it, so the call's tokens are the plain steps' (greedy) or drawn from the same
        distributions (sampled).

        Where it is cut: after a token that completes the grammar (the query after it may only be
        EOS: its mask allows EOS alone, which a plain step emits without sampling) or that brings
        the budget's closing restriction into force (`_restrict`: the query after it gets the
        restricted mask, as the plain step there; no proposal is made at all once it is in force);
        before a position past the budget; before a position whose mask fails or passes its
        deadline; and before the first token the grammar rejects. That last cut depends on the
        token itself, which is exact only for a proposal fixed by the context (n-gram lookup, a
        greedy draft). A proposal drawn at random (`drawn`: a sampling draft, whose q the call
        uses) keeps its first rejected token as its last one instead: its query's mask gives it
        p = 0, so the call rejects it surely and draws from the residual max(0, p - q), which is
        what leaves the output distributed as the target's (a cut there would draw from p itself
        exactly when q drew a rejected token: too often the tokens q favours).

        The matcher is left where it was (llguidance's rollback); the closing heuristic's state
        after each position's mask is kept, and `consume` takes it up as the call's tokens are fed
        (`_ahead`), so its caches end as a plain step's would have."""
        self._ahead = None
        toks = [int(t) for t in tokens]
        if not toks or self.closed_early:
            return 0
        valid = self._m.validate_tokens(toks)
        entry = self._heuristic()
        kept: list[_Closing] = [entry]
        eaten = 0
        whole = True  # every valid token was gone through (no cut before the first rejected one)
        try:
            for i in range(valid):
                self.consume(toks[i])
                eaten += 1
                left = None if budget is None else int(budget) - (i + 1)
                if left is not None and left < 1:
                    whole = False
                    break
                complete = self.done()
                try:
                    self.mask_into(out[i + 1], None if complete else left)
                except GrammarError:
                    whole = False
                    break
                kept.append(self._heuristic())
                if complete or self.closed_early:
                    whole = False
                    break
        finally:
            if eaten and not self._m.rollback(eaten):
                raise GrammarError(f"grammar {self.compiled.kind} could not roll back {eaten} proposed tokens: "
                                   f"{self._m.get_error()}")
            self._restore(entry)
        n = len(kept) - 1
        if drawn and whole and valid < len(toks):
            n += 1  # the first rejected token, checked (and surely rejected) under out[n]
        self._ahead = kept if n else None
        self._ahead_at = 0
        return n

    def _heuristic(self) -> "_Closing":
        """The closing heuristic's state (what llguidance's rollback does not restore)."""
        return _Closing(self._lex.copy(), None if self._path is None else list(self._path), self._cost, self._since,
                        self.closed_early)

    def _restore(self, saved: "_Closing") -> None:
        self._cost, self._since, self.closed_early = saved.cost, saved.since, saved.closed_early
        self._lex, self._path = saved.lex.copy(), None if saved.path is None else list(saved.path)

    def ends_now(self, budget: int | None) -> bool:
        """The budget closed the output early and it is now a complete sentence: the caller ends it
        with EOS (finish "length") instead of letting the model go on."""
        return budget is not None and self.closed_early and self._m.is_accepting()

    def _known_path(self, budget: int) -> list[int] | None:
        """The closing path from here, recomputed near the end of the budget; None when far from
        it (or when none was found)."""
        if self._path is None:
            if budget > self._cost + CLOSE_MARGIN + CLOSE_SLACK and self._since < CLOSE_RECHECK:
                return None  # far from the end: it cannot have grown that much since the last look
            self._path = self.closing_path()
            self._since = 0
            self._cost = MAX_CLOSE_TOKENS if self._path is None else len(self._path)
        return self._path

    def _restrict(self, bits: np.ndarray, budget: int) -> None:
        """Near the end of the budget, clear the bits of the tokens after which the output could
        no longer close within it (`bits`: the row as uint32 words, the grammar's mask in it).
        Plain tokens (content: they cannot open structure) stay while the path has PLAIN_SLACK to
        spare; a token that may open structure (a key, a value, a new call) is checked by its own
        closing path once the path + CLOSE_WIDE reaches the budget (inside a JSON string, where it
        can only end the string, once the path + CLOSE_MARGIN does)."""
        path = self._known_path(budget)
        if path is None or len(path) + CLOSE_WIDE < budget:
            return
        cost, first = len(path), (path[0] if path else None)
        new = np.zeros_like(bits)
        if first is not None and cost >= budget:  # only the path fits now
            new[first >> 5] = np.uint32(1 << (first & 31))
        else:
            narrow = cost + CLOSE_MARGIN >= budget
            in_str = self._lex.in_str
            plain = self.compiled.plain_in if in_str else self.compiled.plain_out
            assert plain is not None  # compiled with the grammar's masks (_plain_bits)
            every = np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little"))
            if len(every) <= EXACT_CHECK_MAX:  # few choices (a choice, a digit, a key): check each
                struct, in_str, narrow = every, False, True
            else:
                if cost + PLAIN_SLACK < budget:
                    np.bitwise_and(bits, plain, out=new)
                struct = np.flatnonzero(np.unpackbits((bits & ~plain).view(np.uint8), bitorder="little"))
            checked = 0
            for t in struct.tolist():
                if t >= self.compiled.vocab_size:
                    break
                if t == self.eos or t == first or (in_str and not narrow):
                    ok = True
                elif checked < EXACT_CHECK_MAX:
                    checked += 1
                    ok = self._cost_after(t) < budget
                else:
                    ok = False
                if ok:
                    new[t >> 5] |= np.uint32(1 << (t & 31))
            if first is not None:
                new[first >> 5] |= np.uint32(1 << (first & 31))
        if (new != bits).any():
            bits[:] = new
            self.closed_early = True

    def _cost_after(self, token: int) -> int:
        """The closing path's length after `token` (MAX_CLOSE_TOKENS + 1 if none)."""
        if token == self.eos:
            return 0
        m = self._m.deep_copy()
        if not m.consume_token(token):
            return MAX_CLOSE_TOKENS + 1
        lex = self._lex.copy()
        lex.feed(self.compiled.tokenizer.decode_bytes([token]))
        path = self._search(m, lex, MAX_CLOSE_TOKENS)
        return MAX_CLOSE_TOKENS + 1 if path is None else len(path)

    def closing_path(self, limit: int = MAX_CLOSE_TOKENS) -> list[int] | None:
        """A short token sequence from here to a complete sentence (greedy, on a copy of the
        matcher): forced tokens when the grammar forces bytes, else the allowed byte of _PREFER
        that most lowers the JSON nesting score (the first in _PREFER's order on a tie), else the
        lowest allowed token. None if none is found within `limit` tokens."""
        return self._search(self._m.deep_copy(), self._lex.copy(), limit)

    def _search(self, m: llg.LLMatcher, lex: "_JsonLex", limit: int) -> list[int] | None:
        row = np.zeros((self.width,), np.int32)
        bits = row.view(np.uint32)
        path: list[int] = []
        while len(path) <= limit:
            if m.is_accepting():
                return path
            if m.is_error():
                return None
            ff = m.compute_ff_tokens()
            if ff:
                if not m.consume_tokens(ff):
                    return None
                lex.feed(self.compiled.tokenizer.decode_bytes(ff))
                path.extend(ff)
                continue
            m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            now = lex.score()
            pick, pick_byte, best = None, None, None
            for byte, t in self.compiled.singles:
                if not (bits[t >> 5] >> (t & 31)) & 1:
                    continue
                score = lex.score_after(byte)  # no trial consume: it costs ~20x the score
                if best is None or score < best:
                    pick, pick_byte, best = t, byte, score
                if score < now:
                    break  # the first byte (in _PREFER's order) that lowers it
            if pick is None:
                allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
                allowed = allowed[(allowed < self.compiled.vocab_size) & (allowed != self.eos)]
                if not len(allowed):
                    return None
                pick = int(allowed[0])
            if not m.consume_token(pick):
                return None
            lex.feed(bytes([pick_byte]) if pick_byte is not None else self.compiled.tokenizer.decode_bytes([pick]))
            path.append(pick)
        return None

    def done(self) -> bool:
        """The grammar is complete: only EOS may follow (or EOS was consumed)."""
        return self._m.is_stopped()

    def accepting(self) -> bool:
        """The output so far is a complete sentence of the grammar (EOS is allowed now)."""
        return self._m.is_accepting()


class _Closing(NamedTuple):
    """A Matcher's closing-heuristic state at one position (Matcher.proposal_masks keeps one a position)."""

    lex: "_JsonLex"
    path: list[int] | None
    cost: int
    since: int
    closed_early: bool


class _JsonLex:
    """Where a byte stream stands in JSON, for the closing heuristic only (the grammar decides
    what is valid): open objects and arrays, inside a string or not, a value or key owed."""

    __slots__ = ("depth", "in_str", "esc", "owed")

    def __init__(self) -> None:
        self.depth, self.in_str, self.esc, self.owed = 0, False, False, False

    def copy(self) -> "_JsonLex":
        c = _JsonLex()
        c.depth, c.in_str, c.esc, c.owed = self.depth, self.in_str, self.esc, self.owed
        return c

    def feed(self, data: bytes) -> None:
        for b in data:
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif b == 0x5C:  # backslash
                    self.esc = True
                elif b == 0x22:
                    self.in_str = False
                continue
            if b == 0x22:
                self.in_str, self.owed = True, False
            elif b in b"{[":
                self.depth += 1
                self.owed = False
            elif b in b"}]":
                self.depth = max(0, self.depth - 1)
                self.owed = False
            elif b in b",:-":
                self.owed = True
            elif b > 0x20:
                self.owed = False

    def score(self) -> int:
        return 2 * self.depth + 2 * self.in_str + self.esc + self.owed

    def score_after(self, byte: int) -> int:
        c = self.copy()
        c.feed(bytes([byte]))
        return c.score()


def all_allowed(rows: int, vocab_size: int) -> np.ndarray:
    """int32 [rows, ceil(vocab / 32)] with every bit set: an unconstrained slot's mask row."""
    return np.full((rows, (vocab_size + 31) // 32), -1, np.int32)


class Grammars:
    """A worker's grammar front: compiled grammars (LRU, `cache_size` from settings) and matchers
    for the model an engine serves. The tokenizer loads on the first constrained request, so a pod
    that never sees one never builds it."""

    def __init__(self, info, *, cache_size: int = DEFAULT_CACHE_SIZE,
                 deadline_s: float = DEFAULT_MASK_DEADLINE_S) -> None:
        self.info = info  # tandem_core.models.ModelInfo: the tokenizer and the mask width
        self.cache_size = int(cache_size)
        self.deadline_s = float(deadline_s)
        self._tokenizer: Tokenizer | None = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from tandem_core.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.info)
        return self._tokenizer

    def compiled(self, spec: dict) -> Compiled:
        return compile_spec(spec, self.tokenizer, vocab_size=self.info.vocab_size, cache_size=self.cache_size)

    def matcher(self, spec: dict, tokens: Sequence[int] = ()) -> Matcher:
        """A matcher past `tokens` (the output so far); InvalidRequest / GrammarError if it cannot be."""
        return self.compiled(spec).matcher(tokens, self.deadline_s)

    def first_masks(self, req) -> np.ndarray | None:
        """Token `start_index`'s masks, one row per choice (they share the grammar and the output so
        far, prompt_ids[output_from:]), for Engine.prefill; None for a request without a grammar.
        The budget (max_tokens - start_index) applies from the first token on."""
        if req.grammar is None:
            return None
        row = self.matcher(req.grammar, req.prompt_ids[req.output_from:]).mask(budget=req.max_tokens - req.start_index)
        return np.tile(row, (max(1, req.n), 1))
