"""A small SentencePiece-style vocabulary for synthetic models, read by llama.cpp's SPM tokenizer.

Layout (as in Llama 2): <unk>, <s>, </s>, the 256 byte-fallback tokens <0x00>..<0xFF>, then
normal pieces, then fillers up to n_vocab. Any text round-trips: what no piece covers falls back to
bytes. llama.cpp's SPM tokenizer merges adjacent symbols only when their concatenation is a token,
so every piece's prefixes are pieces too, and longer pieces score higher so that words grow whole.
"""
from __future__ import annotations

import string
from dataclasses import dataclass

from gguf import TokenType

SPACE = "\u2581"  # SentencePiece's marker for a space
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2

# Common English words, most common first (the order breaks ties between pieces of equal length).
WORDS = """
the of and to a in is it you that he was for on are with as I his they be at one have this from
or had by hot word but what some we can out other were all there when up use your how said an
each she which do their time if will way about many then them write would like so these her long
make thing see him two has look more day could go come did number sound no most people my over
know water than call first who may down side been now find any new work part take get place made
live where after back little only round man year came show every good me give our under name very
through just form sentence great think say help low line differ turn cause much mean before move
right boy old too same tell does set three want air well also play small end put home read hand
port large spell add even land here must big high such follow act why ask men change went light
kind off need house picture try us again animal point mother world near build self earth father
head stand own page should country found answer school grow study still learn plant cover food sun
four between state keep eye never last let thought city tree cross farm hard start might story saw
far sea draw left late run while press close night real life few north open seem together next
white children begin got walk example ease paper group always music those both mark often letter
until mile river car feet care second book carry took science eat room friend began idea fish
mountain stop once base hear horse cut sure watch color face wood main enough plain girl usual
young ready above ever red list though feel talk bird soon body dog family direct pose leave song
measure door product black short numeral class wind question happen complete ship area half rock
order fire south problem piece told knew pass since top whole king space heard best hour better
true during hundred five remember step early hold west ground interest reach fast verb sing listen
six table travel less morning ten simple several vowel toward war lay against pattern slow center
love person money serve appear road map rain rule govern pull cold notice voice unit power town
fine certain fly fall lead cry dark machine note wait plan figure star box noun field rest correct
able pound done beauty drive stood contain front teach week final gave green oh quick develop
ocean warm free minute strong special mind behind clear tail produce fact street inch multiply
nothing course stay wheel full force blue object decide surface deep moon island foot system busy
test record boat common gold possible plane stead dry wonder laugh thousand ago ran check game
shape equate miss brought heat snow tire bring yes distant fill east paint language among
"""

# Word endings and pieces that occur inside words (no space marker).
_SUBWORDS = """
s es ed ing er ers est ly tion tions sion ment ments ness able ible al ial ic ical ous ive ful
less ity ize ise ized en ance ence ant ent ary ory ure age ism ist th re un in dis pre pro con com
ex per ter ter ar or an on at it le el ll ss tt ck qu ch sh ph wh gh ough ight
"""

# Llama's token types; byte tokens must be BYTE or llama.cpp cannot map bytes back to them.
_SPECIALS = [("<unk>", TokenType.UNKNOWN), ("<s>", TokenType.CONTROL), ("</s>", TokenType.CONTROL)]


@dataclass(frozen=True)
class Vocab:
    tokens: list[str]
    scores: list[float]
    types: list[int]


def _prefix_closed(pieces: list[str]) -> list[str]:
    """Each piece preceded by all its prefixes of length >= 2, first occurrence kept."""
    seen: dict[str, None] = {}
    for piece in pieces:
        for n in range(2, len(piece) + 1):
            seen.setdefault(piece[:n], None)
    return list(seen)


def _word_pieces() -> list[str]:
    """Multi-character pieces, most common first; each comes after its prefixes, so any leading
    part of the list is prefix-closed and a small vocabulary holds the commonest words whole."""
    pieces = _SUBWORDS.split()
    for w in WORDS.split():
        pieces += [SPACE + w, SPACE + w.capitalize(), w]
    return _prefix_closed(pieces)


def _base_pieces() -> list[str]:
    """Single characters: the space marker and every printable ASCII character but space."""
    chars = [c for c in string.printable if c.isprintable() and c != " "]
    return [SPACE] + chars


def min_vocab_size() -> int:
    return len(_SPECIALS) + 256 + len(_base_pieces())


def build_vocab(n_vocab: int) -> Vocab:
    """Specials, bytes, pieces and fillers: exactly n_vocab tokens, the same for the same n_vocab."""
    if n_vocab < min_vocab_size():
        raise ValueError(f"n_vocab must be at least {min_vocab_size()}")
    tokens = [t for t, _ in _SPECIALS]
    types = [int(tt) for _, tt in _SPECIALS]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [int(TokenType.BYTE)] * 256
    scores = [0.0] * len(tokens)

    pieces = (_base_pieces() + _word_pieces())[: n_vocab - len(tokens)]
    # Longer pieces win; among equally long ones, the earlier (more common) one wins.
    scores += [len(p) - i / len(pieces) for i, p in enumerate(pieces)]
    tokens += pieces
    types += [int(TokenType.NORMAL)] * len(pieces)

    # Fillers are never produced by tokenizing text (their prefixes are not all pieces), but a
    # model can emit them, and they detokenize to plain text.
    n_fill = n_vocab - len(tokens)
    tokens += [f"{SPACE}tok{i}" for i in range(len(tokens), len(tokens) + n_fill)]
    scores += [-1.0] * n_fill
    types += [int(TokenType.NORMAL)] * n_fill
    return Vocab(tokens, scores, types)
