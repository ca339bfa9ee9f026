"""Exercise 14, the incremental detokenizer with stop strings: a spec on a byte-level toy
tokenizer (each token id is a few bytes; bytes that end mid-character decode to U+FFFD, as
HF's byte-level tokenizers do), then the real engine with the student's classes plugged in.
Every check fails with the case that broke, what differs and what to check."""
import pytest

import llmlab
from diagnose import fail

EXERCISE = "ex14_detokenizer"


def expect(ok, case: str, what: str, hint: str) -> None:
    if not ok:
        fail(case, [what, f"-> {hint}"])


class ByteTokenizer:
    """Token id -> bytes (`pieces`, else b"a"); decodes as UTF-8, U+FFFD for a cut character.
    Records the longest list it was asked to decode."""

    def __init__(self, pieces: dict[int, bytes]):
        self.pieces, self.longest = {0: b"", **pieces}, 0

    def decode(self, token_ids, skip_special_tokens=True) -> str:
        self.longest = max(self.longest, len(token_ids))
        return b"".join(self.pieces.get(t, b"a") for t in token_ids).decode("utf-8", errors="replace")


def pieces_of(ex, pieces: dict[int, bytes], token_ids: list[int]) -> list[str]:
    detokenizer = ex.IncrementalDetokenizer(ByteTokenizer(pieces), [0])
    return [detokenizer.add_token(t) for t in token_ids]


def stream(ex, pieces: dict[int, bytes], token_ids: list[int], stop: list[str]):
    """Feed an OutputText its tokens one at a time, as the engine does: the text shown after
    each token, the index of the token a stop string ended it at (None: it ended after the
    last token for another reason, which releases the held-back tail), the final text."""
    text = ex.OutputText(ex.IncrementalDetokenizer(ByteTokenizer(pieces), [0]), list(stop))
    shown, stopped_at = [], None
    for i, token in enumerate(token_ids):
        if text.add_token(token):
            stopped_at = i
            break
        shown.append(text.text)
    if stopped_at is None:
        text.finish()
    return shown, stopped_at, text


# é is 2 bytes, € 3, 🙂 4: split over tokens in every way
UTF8 = {1: b"h", 2: b"\xc3", 3: b"\xa9", 4: b" x", 5: b"\xe2\x82", 6: b"\xac", 7: b"\xf0", 8: b"\x9f\x99\x82",
        9: b"\xf0\x9f", 10: b"\x99", 11: b"\x82 ok"}


def test_a_character_split_over_tokens_waits(ex):
    case = "'é' split over two tokens (bytes c3 | a9)"
    got = pieces_of(ex, UTF8, [1, 2, 3, 4])
    expect("\ufffd" not in "".join(got), case, f"the pieces were {got!r}: U+FFFD (a half character) was shown",
           "a UTF-8 character was split: when the window's text ends in U+FFFD the token completes no character "
           "yet: return \"\" and keep it in the window (do not advance the offsets)")
    expect(got == ["h", "", "é", " x"], case, f"the pieces were {got!r}, expected ['h', '', 'é', ' x']",
           "return only the text the new token completes: decode the window with and without it, return the "
           "difference")


@pytest.mark.parametrize("tokens,text", [([5, 6, 4], "€ x"), ([7, 8, 1], "🙂h"), ([9, 10, 11], "🙂 ok"),
                                         ([1, 9, 10, 11, 2, 3], "h🙂 oké")],
                         ids=["3 bytes as 2+1", "4 bytes as 1+3", "4 bytes as 2+1+1", "mixed"])
def test_pieces_add_up_to_the_text(ex, tokens, text):
    case = f"tokens {tokens} (text {text!r})"
    got = pieces_of(ex, UTF8, tokens)
    expect("".join(got) == text and "\ufffd" not in "".join(got), case, f"the pieces were {got!r}",
           "a UTF-8 character was split or lost: the pieces, joined, are the decode of all the tokens; a "
           "window ending in U+FFFD waits for the next token")


def test_work_per_token_does_not_grow(ex):
    case = "500 tokens"
    tokenizer = ByteTokenizer({1: b"ab "})
    detokenizer = ex.IncrementalDetokenizer(tokenizer, [0])
    text = "".join(detokenizer.add_token(1) for _ in range(500))
    expect(text == "ab " * 500, case, f"the text is {len(text)} characters, expected {3 * 500}",
           "each token's text is returned once")
    expect(tokenizer.longest <= 16, case, f"decode was called on {tokenizer.longest} tokens at once",
           "decode a short window (from prefix_offset), not the whole output: move the window on once a "
           "token completes text")


STOPS = {1: b"ab", 2: b"ST", 3: b"OP", 4: b"cd", 5: b"xSTOPy", 6: b"S", 7: b"T"}


def test_a_stop_string_split_across_tokens_is_never_shown(ex):
    case = "stop 'STOP' arriving as 'ST' + 'OP'"
    shown, stopped_at, text = stream(ex, STOPS, [1, 2, 3, 4], ["STOP"])
    leaked = [s for s in shown[:2] if "S" in s]     # the text shown before 'OP' arrived
    expect(not leaked, case, f"the text shown after each token was {shown!r}: 'ST' was shown before the stop "
                             "string was complete",
           "a stop string leaked across tokens: hold back the end of the text that could still be the start of a "
           "stop string (up to len(longest stop) - 1 characters) until the next token decides")
    expect(stopped_at == 2, case, f"'ST' was held back, but add_token returned False when 'OP' completed the stop "
                                  f"string (stopped at token {stopped_at}; the text shown after each token was "
                                  f"{shown!r})",
           "a stop string split across tokens was never found: search pending + the new piece, not the new piece "
           "alone: the stop string ends in the new piece but starts in the held-back tail")
    expect("STOP" not in text.text, case, f"the text is {text.text!r}: the stop string is in it",
           "stop text shown: the stop string itself is never part of the text; release only what comes before "
           "it (the window up to where the stop starts), not through its end")
    expect(text.text == "ab" and text.stopped_on == "STOP", case,
           f"stopped at token {stopped_at} with text {text.text!r}, stopped_on {text.stopped_on!r}",
           "cut the text before the stop string (it starts in the held-back tail), and set stopped_on to it")


def test_the_whole_hold_back_is_kept(ex):
    """A stop string of 3 characters whose first 2 (or 1) arrive with one token: all of them must
    stay held back (hold_back = 2), or the first one is shown and the stop is never found."""
    for first, second in [(".\n", "\n"), (".", "\n\n")]:
        case = f"stop '.\\n\\n' arriving as {first!r} + {second!r} after 'ab'"
        pieces = {1: b"ab", 8: first.encode(), 9: second.encode()}
        shown, stopped_at, text = stream(ex, pieces, [1, 8, 9], [".\n\n"])
        expect(stopped_at == 2 and text.text == "ab", case,
               f"stopped at token {stopped_at}, text {text.text!r}; the text shown after each token was {shown!r}",
               "hold back exactly the last hold_back = len(longest stop) - 1 characters: release "
               "text[:len(text) - hold_back] (check the arithmetic: one character less held back lets the start "
               "of a stop string out, and the search then never sees it whole)")


def test_a_stop_string_inside_one_token(ex):
    case = "stop 'STOP' inside one token 'xSTOPy'"
    shown, stopped_at, text = stream(ex, STOPS, [1, 5, 4], ["STOP"])
    expect("STOP" not in text.text, case, f"the text is {text.text!r}: the stop string is in it",
           "stop text shown: the stop string itself is never part of the text; release only what comes before "
           "it (the window up to where the stop starts), not through its end")
    expect(stopped_at == 1 and text.text == "abx", case, f"stopped at token {stopped_at} with text {text.text!r}",
           "cut the text before the stop string; nothing after it is shown")


def test_the_earliest_stop_string_wins(ex):
    case = "stops ['OP', 'ST'] in 'abSTOP'"
    _, stopped_at, text = stream(ex, STOPS, [1, 2, 3], ["OP", "ST"])
    expect(stopped_at == 1 and text.text == "ab" and text.stopped_on == "ST", case,
           f"stopped at token {stopped_at}, text {text.text!r}, stopped_on {text.stopped_on!r}",
           "when several stop strings appear, the one that starts first wins")
    # both stop strings in one token's text: the earlier in the text wins, not the earlier in the list
    case = "stops ['OP', 'ST'], both inside one token 'xSTOPy'"
    _, stopped_at, text = stream(ex, STOPS, [1, 5], ["OP", "ST"])
    expect(stopped_at == 1 and text.text == "abx" and text.stopped_on == "ST", case,
           f"stopped at token {stopped_at}, text {text.text!r}, stopped_on {text.stopped_on!r}; expected text "
           "'abx', stopped_on 'ST'",
           "the first stop string of the list won, not the earliest in the text: of every stop string found in the "
           "window, cut at the one that starts first (min over (position, stop))" if text.stopped_on == "OP" else
           "when several stop strings appear in one window, the one that starts first wins")


def test_a_false_start_is_released(ex):
    case = "stop 'STOP', text 'abS' 'T' 'cd' (no stop), then finish"
    shown, stopped_at, text = stream(ex, STOPS, [1, 6, 7, 4], ["STOP"])
    expect(stopped_at is None, case, f"stopped at token {stopped_at}", "'STcd' is no stop string")
    expect(text.text == "abSTcd", case, f"the final text is {text.text!r}, expected 'abSTcd'",
           "finish releases the held-back tail (pending); a held-back start that turned out not to be a stop "
           "is released once it can no longer be one")
    expect(shown[-1].startswith("abS"), case, f"after 'cd' the text shown was {shown[-1]!r}",
           "hold back only what can still be the start of a stop string (the last hold_back characters)")


def test_without_stop_strings_nothing_is_held_back(ex):
    case = "no stop strings"
    shown, stopped_at, text = stream(ex, STOPS, [1, 2, 4], [])
    expect(shown == ["ab", "abST", "abSTcd"] and stopped_at is None, case, f"the text shown was {shown!r}",
           "with no stop string (hold_back 0) every piece is shown at once")


@pytest.mark.slow   # the 30-layer model, several engine runs
def test_end_to_end(ex, llm):
    """The engine with your detokenizer and OutputText: the same texts and finish reasons as
    llmlab's, with a stop string that spans two tokens of the greedy output."""
    prompts = ["The capital of France is", "Once upon a time, in a small village by the sea, there lived"]
    greedy = llmlab.SamplingParams(max_tokens=12, temperature=0.0)

    def run(**plugged):
        config = llmlab.EngineConfig(device="cpu", dtype="float32", backend="torch", num_gpu_blocks=64)
        engine = llmlab.LLMEngine(config, model=llm.engine.model, tokenizer=llm.tokenizer, **plugged)
        tokens = llmlab.LLM.from_engine(engine).generate(prompts[:1], greedy)[0].token_ids
        # a stop string across the boundary of the 3rd and 4th output tokens
        before, after = llm.tokenizer.decode(tokens[:3]), llm.tokenizer.decode(tokens[:4])
        stop = before[-2:] + after[len(before):len(before) + 1]
        params = llmlab.SamplingParams(max_tokens=12, temperature=0.0, stop=[stop])
        outputs = llmlab.LLM.from_engine(engine).generate(prompts, params)
        return stop, [(o.text, o.finish_reason) for o in outputs]

    stop, expected = run()
    _, actual = run(detokenizer=ex.IncrementalDetokenizer, output_text=ex.OutputText)
    expect(actual == expected, f"the engine with your classes, stop string {stop!r}",
           f"texts and finish reasons {actual!r}, expected {expected!r}",
           "compare with the cases above: a stop string shown or missed across tokens, a character split")
