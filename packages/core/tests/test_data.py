"""Data pipeline: FASTA reading, tokenizer, data sources, token cache, windows and the sampler."""

import gzip
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from megaseq.alphabets import PROTEIN, Alphabet
from megaseq.data import (
    DataError,
    GenomeWindows,
    WindowSampler,
    decode,
    encode,
    fasta,
    fetch,
    is_softmasked,
    read_fasta,
    resolve_fasta,
    sources,
    token_ids,
    token_metadata,
    tokenized,
    windows,
)
from megaseq.data.tokenizer import N_ID, SOFTMASK_FLAG
from megaseq.errors import UserError
from megaseq.hookspecs import hookimpl
from megaseq.records import DataSourceSpec
from megaseq_testkit import fresh_plugins

MULTI_RECORD = b">chr1 first record\nACGTac\r\ngtNN\n\n>empty\n>chr3\nRYkm\nACGT"
MULTI_RECORD_PARSED = [("chr1", b"ACGTacgtNN"), ("empty", b""), ("chr3", b"RYkmACGT")]


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own cache, so nothing touches ~/.cache."""
    monkeypatch.setenv("MEGASEQ_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def oracle_fasta(text: bytes) -> list[tuple[str, bytes]]:
    """Line-by-line reference parser."""
    records: list[tuple[str, bytes]] = []
    for line in text.splitlines():
        if line.startswith(b">"):
            words = line[1:].decode().split()
            records.append((words[0] if words else "", b""))
        elif line.strip():
            name, seq = records[-1]
            records[-1] = (name, seq + b"".join(line.split()))
    return records


def random_fasta(rng: random.Random) -> bytes:
    parts = []
    for record in range(rng.randint(1, 4)):
        parts.append(f">rec{record} some description\n".encode())
        seq = "".join(rng.choice("ACGTNacgtnRY") for _ in range(rng.randint(0, 300)))
        width = rng.randint(1, 70)
        newline = rng.choice(["\n", "\r\n"])
        parts.append(newline.join(seq[i : i + width] for i in range(0, len(seq), width)).encode() + b"\n")
    return b"".join(parts)


# ---------------------------------------------------------------- FASTA


def test_read_fasta_plain_multi_record(tmp_path: Path) -> None:
    path = tmp_path / "multi.fa"
    path.write_bytes(MULTI_RECORD)
    assert list(read_fasta(path)) == MULTI_RECORD_PARSED


def test_read_fasta_gzip_and_bgzip_multi_member(tmp_path: Path) -> None:
    gz = tmp_path / "multi.fa.gz"
    gz.write_bytes(gzip.compress(MULTI_RECORD))
    # bgzip = independent gzip members back to back; cut inside a header and inside a sequence line.
    members = [MULTI_RECORD[:3], MULTI_RECORD[3:17], MULTI_RECORD[17:40], MULTI_RECORD[40:]]
    bgz = tmp_path / "multi.bgz"  # compression is detected from the content, not the name
    bgz.write_bytes(b"".join(gzip.compress(member) for member in members))
    assert list(read_fasta(gz)) == MULTI_RECORD_PARSED
    assert list(read_fasta(bgz)) == MULTI_RECORD_PARSED


@pytest.mark.parametrize("block_bytes", [1, 2, 7, 64, 1 << 22])
def test_read_fasta_matches_line_oracle_across_block_sizes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block_bytes: int
) -> None:
    monkeypatch.setattr(fasta, "READ_BLOCK_BYTES", block_bytes)
    rng = random.Random(block_bytes)
    for case in range(5):
        text = random_fasta(rng)
        path = tmp_path / f"case{case}.fa.gz"
        path.write_bytes(gzip.compress(text))
        assert list(read_fasta(path)) == oracle_fasta(text)


def test_real_excerpt_reads_as_one_record() -> None:
    [(name, seq)] = list(read_fasta(fetch("excerpt-chr20")))
    assert name == "20:40000001-40300000"
    assert len(seq) == 300_000 and set(seq) <= set(b"ACGT")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"ACGT\n>late header\nACGT\n", "no '>' header line"),
        (b"", "no '>' header line"),
        (b"\n\n  \n", "no '>' header line"),
        (gzip.compress(b">x\n" + b"ACGT" * 1000)[:-12], "cannot read FASTA file"),  # truncated gzip
        (b"\x1f\x8bnot really gzip", "cannot read FASTA file"),
    ],
)
def test_malformed_fasta_is_one_line_data_error(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.fa"
    path.write_bytes(content)
    with pytest.raises(DataError, match=message) as info:
        list(read_fasta(path))
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_data_error_is_a_user_error_for_the_cli() -> None:
    assert issubclass(DataError, UserError)


def test_missing_fasta_is_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"missing\.fa"):
        list(read_fasta(tmp_path / "missing.fa"))


# ---------------------------------------------------------------- tokenizer


def test_encode_case_folding_and_softmask_flag() -> None:
    tokens = encode(b"ACGTNacgtn")
    assert tokens.dtype == np.uint8
    assert tokens.tolist() == [0, 1, 2, 3, 4, 8, 9, 10, 11, 12]
    assert token_ids(tokens).tolist() == [0, 1, 2, 3, 4] * 2
    assert is_softmasked(tokens).tolist() == [False] * 5 + [True] * 5
    assert decode(tokens) == "ACGTNacgtn"


def test_iupac_codes_become_n() -> None:
    tokens = encode(b"RYKMSWBDHVrykmswbdhv")
    assert token_ids(tokens).tolist() == [N_ID] * 20
    assert is_softmasked(tokens).tolist() == [False] * 10 + [True] * 10
    assert decode(tokens) == "N" * 10 + "n" * 10


def test_every_other_byte_is_rejected() -> None:
    allowed = set(b"ACGTNRYKMSWBDHVacgtnrykmswbdhv")
    for byte in range(256):
        if byte in allowed:
            encode(bytes([byte]))
        else:
            with pytest.raises(DataError, match="invalid nucleotide character"):
                encode(b"AC" + bytes([byte]))


def test_bad_character_error_names_char_and_offset() -> None:
    with pytest.raises(DataError, match=r"invalid nucleotide character 'U' at offset 3; allowed: A C G T N"):
        encode(b"ACGUA")


def test_protein_alphabet_encodes_every_amino_acid_and_keeps_iupac_letters_apart() -> None:
    """In the protein alphabet the letters that are also IUPAC nucleotide codes (R, Y, K, M, S, W, D, H, V) and
    C, G, T, N are amino acids of their own: nothing becomes N or X except the unknown and ambiguous codes."""
    letters = PROTEIN.letters.encode()
    tokens = encode(letters + letters.lower(), PROTEIN)
    assert token_ids(tokens, PROTEIN).tolist() == list(range(20)) * 2
    assert is_softmasked(tokens, PROTEIN).tolist() == [False] * 20 + [True] * 20
    assert decode(tokens, PROTEIN) == PROTEIN.letters + PROTEIN.letters.lower()
    assert token_ids(encode(b"XBZJUOxb", PROTEIN), PROTEIN).tolist() == [PROTEIN.unknown_id] * 8
    assert (PROTEIN.unknown_id, PROTEIN.softmask_flag, PROTEIN.size) == (20, 32, 21)
    with pytest.raises(DataError, match=r"invalid amino acid character '\*' at offset 2; allowed: A C D E F"):
        encode(b"MK*", PROTEIN)


def test_a_protein_read_as_dna_is_refused_with_a_hint() -> None:
    with pytest.raises(DataError, match=r"invalid nucleotide character 'E' at offset 2.*\(protein\? a data source that "
                       "declares alphabet = megaseq.alphabets.PROTEIN"):
        encode(b"MKEL")


def test_alphabets_are_checked_when_made() -> None:
    with pytest.raises(ValueError, match="distinct upper case ASCII letters"):
        Alphabet("rna", "ACGU", "N", ambiguous="A")
    rna = Alphabet("rna", "ACGU", "N", unit="base")
    assert (rna.size, rna.softmask_flag, rna.id_mask) == (5, 8, 7)
    assert DataSourceSpec(name="x", target="m:f", alphabet="protein").alphabet is PROTEIN
    with pytest.raises(ValueError, match="unknown alphabet 'rna'; core's alphabets: dna, protein"):
        DataSourceSpec(name="x", target="m:f", alphabet="rna")


# ---------------------------------------------------------------- datasets and fetch


def test_unknown_dataset_lists_known_names() -> None:
    with pytest.raises(DataError, match="unknown dataset 'chr99'; known datasets: excerpt-chr20, excerpt-chrX"):
        fetch("chr99", plugins=fresh_plugins())


def test_a_dataset_of_a_plugin_that_is_not_installed_says_to_install_it() -> None:
    with pytest.raises(DataError, match="'grch37-chrX' is neither a known dataset.*is the plugin that provides it installed"):
        tokenized("grch37-chrX", plugins=fresh_plugins())


def test_resolve_fasta_rejects_unknown_spec(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="neither a known dataset"):
        resolve_fasta(str(tmp_path / "nope.fa"))


def test_excerpts_resolve_inside_the_package_without_fetching() -> None:
    for name in ("excerpt-chr20", "excerpt-chrX"):
        path = resolve_fasta(name)
        assert path.is_file() and path.is_relative_to(Path(sources.__file__).parent)


# ---------------------------------------------------------------- token cache


def test_tokenized_joins_records_with_one_n_and_records_metadata(
    tmp_path: Path, isolated_cache: Path
) -> None:
    path = tmp_path / "multi.fa"
    path.write_bytes(MULTI_RECORD)
    tokens = tokenized(str(path))
    assert isinstance(tokens, np.memmap) and not tokens.flags.writeable
    assert decode(tokens) == "ACGTacgtNN" + "N" + "" + "N" + "NNnnACGT"  # RYkm -> NNnn
    meta = token_metadata(str(path))
    assert meta["tokens"] == 20 and meta["source"] == str(path.resolve())
    assert meta["records"] == [
        {"name": "chr1", "offset": 0, "length": 10},
        {"name": "empty", "offset": 11, "length": 0},
        {"name": "chr3", "offset": 12, "length": 8},
    ]
    # counts are of the records' letters: the two N that join the three records are separators, not counted
    assert meta["counts"] == {"A": 3, "C": 3, "G": 3, "T": 3, "N": 6, "softmasked": 6}
    assert meta["separators"] == 2 and meta["alphabet"] == "dna"
    assert meta["tokens"] == sum(r["length"] for r in meta["records"]) + meta["separators"]
    assert [p.suffix for p in sorted((isolated_cache / "tokens").iterdir())] == [".json", ".u8"]


def test_tokenized_reuses_cache_and_rebuilds_when_source_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "one.fa"
    path.write_bytes(b">a\nACGT\n")
    assert decode(tokenized(str(path))) == "ACGT"

    def must_not_run(*args: object) -> dict:
        raise AssertionError("token cache was rebuilt")

    with monkeypatch.context() as patch:
        patch.setattr(sources, "_write_tokens", must_not_run)
        assert decode(tokenized(str(path))) == "ACGT"
    path.write_bytes(b">a\nGGGGG\n")  # new size (and mtime) -> new cache key
    assert decode(tokenized(str(path))) == "GGGGG"


def test_tokenized_failure_leaves_no_cache_entry(tmp_path: Path, isolated_cache: Path) -> None:
    path = tmp_path / "bad.fa"
    path.write_bytes(b">ok\nACGT\n>broken\nAC\nGTXA\n")
    with pytest.raises(DataError, match=r"record 'broken' position 4: invalid nucleotide character 'X'"):
        tokenized(str(path))
    assert list((isolated_cache / "tokens").iterdir()) == []  # neither result nor temporary files


class MiscountedExcerpt:
    """The chrX excerpt declared one base longer than it is."""

    @hookimpl
    def megaseq_data_source(self):
        return [DataSourceSpec(name="miscounted", target="megaseq.data.sources:excerpt_chrx", bases=200_001, n_bases=0)]


def test_tokenized_rejects_a_dataset_with_wrong_counts(isolated_cache: Path) -> None:
    """The error names the declaration that disagrees with the file, not only the file."""
    plugins = fresh_plugins()
    plugins.register(MiscountedExcerpt(), name="miscounted")
    with pytest.raises(DataError) as err:
        tokenized("miscounted", plugins=plugins)
    message = str(err.value)
    assert message.startswith("data source 'miscounted' from (local) declares bases = 200,001 on its record, but its file ")
    assert "holds 200,000 bases in 1 record(s)" in message and "correct DataSourceSpec.bases" in message
    assert "\n" not in message
    assert list((isolated_cache / "tokens").iterdir()) == []


class TwoRecordsWrongN:
    """A two-record corpus whose n_bases counts the N between its records."""

    @hookimpl
    def megaseq_data_source(self):
        return [DataSourceSpec(name="two", target=f"{__name__}:two_records", bases=8, n_bases=3)]


def two_records(request) -> Path:
    path = request.cache_dir / "two.fa"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        path.write_text(">a\nACNN\n>b\nNGTA\n")
    return path


def test_declared_counts_do_not_count_the_separators(isolated_cache: Path) -> None:
    """bases counts every letter of the records (8), n_bases the N among them (3), the separator neither."""
    plugins = fresh_plugins()
    plugins.register(TwoRecordsWrongN(), name="two")
    meta = token_metadata("two", plugins=plugins)
    assert (meta["tokens"], meta["separators"], meta["counts"]["N"]) == (9, 1, 3)

    class SeparatorCounted:
        @hookimpl
        def megaseq_data_source(self):
            return [DataSourceSpec(name="two4", target=f"{__name__}:two_records", bases=8, n_bases=4)]

    plugins.register(SeparatorCounted(), name="two4")
    with pytest.raises(DataError, match=r"declares n_bases = 4 on its record, but its file .* holds 3 N bases in 2 record"):
        tokenized("two4", plugins=plugins)


def test_tokenized_excerpts_match_dataset_counts() -> None:
    registry = fresh_plugins().registry["data_source"]
    for name in ("excerpt-chr20", "excerpt-chrX"):
        meta = token_metadata(name)
        counts = meta["counts"]
        assert meta["tokens"] == registry[name].spec.bases == sum(counts[b] for b in "ACGTN")  # one record each
        assert counts["N"] == registry[name].spec.n_bases and counts["softmasked"] == 0


# ---------------------------------------------------------------- windows


def oracle_window_starts(
    tokens: np.ndarray, seq_len: int, stride: int, max_n: float, soft_weight: float
) -> list:
    starts = []
    for start in range(0, len(tokens) - seq_len, stride):
        targets = tokens[start + 1 : start + seq_len + 1]
        n = int(np.sum(targets & 7 == N_ID))
        zero = n if soft_weight > 0 else int(np.sum((targets & 7 == N_ID) | (targets & 8 != 0)))
        if n <= max_n * seq_len and zero < seq_len:
            starts.append(start)
    return starts


def random_tokens(rng: np.random.Generator, length: int) -> np.ndarray:
    tokens = rng.integers(0, 4, length).astype(np.uint8)
    for _ in range(length // 40):  # N runs of varied length, like assembly gaps
        begin = int(rng.integers(0, length))
        tokens[begin : begin + int(rng.integers(1, 30))] = N_ID
    tokens[rng.random(length) < 0.3] |= SOFTMASK_FLAG
    return tokens


@pytest.mark.parametrize("prefix_block", [5, 64, 1 << 22])
def test_window_selection_matches_oracle(monkeypatch: pytest.MonkeyPatch, prefix_block: int) -> None:
    monkeypatch.setattr(windows, "_PREFIX_BLOCK", prefix_block)
    rng = np.random.default_rng(prefix_block)
    for length, seq_len, stride, max_n, soft_weight in [
        (997, 13, None, 0.5, 1.0),
        (1000, 7, 3, 0.2, 0.1),
        (513, 31, 50, 1.0, 0.0),
        (300, 1, None, 0.0, 1.0),
    ]:
        tokens = random_tokens(rng, length)
        got = GenomeWindows(tokens, seq_len, max_n_fraction=max_n, softmask_weight=soft_weight, stride=stride)
        expected = oracle_window_starts(tokens, seq_len, stride or seq_len, max_n, soft_weight)
        assert got.starts.tolist() == expected and len(got) == len(expected)


def test_default_windows_tile_targets_without_overlap() -> None:
    tokens = encode(b"ACGTACGTACGTA")  # 13 tokens, seq_len 4 -> 3 windows, one token left over
    data = GenomeWindows(tokens, 4)
    assert data.starts.tolist() == [0, 4, 8]
    batch = data.batch([0, 2])
    assert batch.inputs.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert batch.targets.tolist() == [[1, 2, 3, 0], [1, 2, 3, 0]]
    assert batch.inputs.dtype == batch.targets.dtype == torch.int64 and batch.weights.dtype == torch.float32


def test_stride_gives_overlapping_windows() -> None:
    data = GenomeWindows(encode(b"ACGTACGTAC"), 4, stride=2)
    assert data.starts.tolist() == [0, 2, 4]
    assert data.batch([1]).inputs.tolist() == [[2, 3, 0, 1]]


def test_weights_zero_on_n_targets_and_softmask_weight() -> None:
    tokens = encode(b"AcgNtNAC")
    batch = GenomeWindows(tokens, 7, softmask_weight=0.1).batch([0])
    assert batch.inputs.tolist() == [[0, 1, 2, 4, 3, 4, 0]]  # flag stripped
    assert batch.targets.tolist() == [[1, 2, 4, 3, 4, 0, 1]]
    torch.testing.assert_close(batch.weights, torch.tensor([[0.1, 0.1, 0.0, 0.1, 0.0, 1.0, 1.0]]))


def test_mostly_n_windows_are_skipped() -> None:
    tokens = encode(b"A" + b"ACGT" + b"NNNA" + b"NNNN" + b"ACNN")
    data = GenomeWindows(tokens, 4)
    assert data.starts.tolist() == [0, 12]  # windows with 3/4 and 4/4 N targets dropped; 2/4 kept
    assert GenomeWindows(tokens, 4, max_n_fraction=0.0).starts.tolist() == [0]


def test_no_window_with_all_zero_weights_even_when_allowed_by_n_fraction() -> None:
    tokens = encode(b"A" + b"NNNN" + b"acgt" + b"ACGT")
    assert GenomeWindows(tokens, 4, max_n_fraction=1.0).starts.tolist() == [4, 8]
    only_real = GenomeWindows(tokens, 4, max_n_fraction=1.0, softmask_weight=0.0)
    assert only_real.starts.tolist() == [8]
    assert bool((only_real.batch(range(len(only_real))).weights.sum(1) > 0).all())


def test_too_short_or_all_n_sequences_give_no_windows() -> None:
    assert len(GenomeWindows(encode(b"ACG"), 4)) == 0
    assert len(GenomeWindows(encode(b"A" + b"N" * 20), 4, max_n_fraction=1.0)) == 0


def test_window_errors_are_one_line() -> None:
    with pytest.raises(ValueError, match="max_n_fraction must be in"):
        GenomeWindows(encode(b"ACGTA"), 4, max_n_fraction=1.5)
    with pytest.raises(ValueError, match="stride must be >= 1"):
        GenomeWindows(encode(b"ACGTA"), 4, stride=0)


def test_windows_over_cached_memmap() -> None:
    data = GenomeWindows(tokenized("excerpt-chrX"), 1000)
    assert len(data) == 199  # 200,000 tokens, no N: (200,000 - 1) // 1000 windows
    assert decode(data.batch([5]).inputs[0].numpy().astype(np.uint8)) == decode(
        tokenized("excerpt-chrX")[5000:6000]
    )


# ---------------------------------------------------------------- sampler


def test_sampler_epochs_are_permutations_and_deterministic() -> None:
    sampler = WindowSampler(10, batch_size=4, seed=7)
    drawn = [sampler.next_indices() for _ in range(5)]  # 20 indices = exactly two epochs
    flat = [i for batch in drawn for i in batch]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] != flat[10:]  # a fresh order each epoch
    again = WindowSampler(10, batch_size=4, seed=7)
    assert [again.next_indices() for _ in range(5)] == drawn
    other = WindowSampler(10, batch_size=4, seed=8)
    assert [other.next_indices() for _ in range(5)] != drawn


def test_sampler_resume_continues_the_same_order() -> None:
    reference = WindowSampler(7, batch_size=3, seed=1)
    expected = [reference.next_indices() for _ in range(9)]
    for stop in (0, 2, 3, 5):  # stops inside and at the end of epochs
        sampler = WindowSampler(7, batch_size=3, seed=1)
        head = [sampler.next_indices() for _ in range(stop)]
        state = json.loads(json.dumps(sampler.state_dict()))  # must survive a checkpoint round trip
        resumed = WindowSampler(7, batch_size=3, seed=1)
        resumed.load_state_dict(state)
        assert head + [resumed.next_indices() for _ in range(9 - stop)] == expected


def test_sampler_batch_larger_than_dataset() -> None:
    batch = WindowSampler(3, batch_size=7, seed=0).next_indices()
    assert len(batch) == 7 and sorted(batch[:3]) == [0, 1, 2] and sorted(batch[3:6]) == [0, 1, 2]


def test_sampler_rejects_state_for_other_data() -> None:
    state = WindowSampler(5, batch_size=2, seed=0).state_dict()
    with pytest.raises(ValueError, match="sampler state is for 5 windows with seed 0"):
        WindowSampler(6, batch_size=2, seed=0).load_state_dict(state)
