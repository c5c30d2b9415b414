"""MTP self-speculation (`--mtp`): the Qwen3.5 MTP head, where its weights come from, its norm
convention, and lossless speculation with it.

Targets are tiny random Qwen3.5 checkpoints (`build_tiny_qwen3_5`) given random MTP heads
(`random_mtp_head`): inside the model's safetensors (as the original Qwen releases ship them),
as a Hugging Face-convention sidecar, and as an MLX-convention sidecar (norms stored as 1 + w,
metadata format=mlx). transformers drops the head, so its formula is checked against a head
assembled from transformers' own Qwen3.5 decoder layer and RMSNorm.
"""
from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.spec.conftest import greedy, spec_engine
from tests.spec.test_sampling import chi_square
from verispec.cache.kv import KVCache
from verispec.cache.paged import BatchCache
from verispec.cli import main as cli_main
from tools.tiny import build_tiny_qwen3_5, corpus_text, random_mtp_head, write_mtp_sidecar
from verispec.engine.engine import Engine, load_engine
from verispec.sampling.params import SamplingParams
from verispec.errors import VerispecError
from verispec.loading.model_loader import load_model
from verispec.models.layers.norm import RMSNorm
from verispec.spec import mtp as mtp_module
from verispec.spec.mtp import MtpHidden, MtpProposer, NormConvention, head_tensor_name, load_mtp_head

NEW_TOKENS = 48
PREFILL_STEP = 16  # the longer prompts span several chunks: the head's cache fills chunk by chunk
PROMPTS = [
    "def fibonacci(n):",
    "import collections\n\nclass Counter(dict):\n    def __init__(self, iterable=None, /, **kwds):",
    "x",
]
SOURCES = ("shards", "hf-sidecar", "mlx-sidecar")


def add_to_shard(model_dir: Path, extra: dict) -> None:
    """Rewrite model.safetensors with `extra` tensors added (as a checkpoint that ships the head)."""
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    tensors.update(extra)
    save_file(tensors, str(path), metadata={"format": "pt"})


def strip_head(tensors: dict) -> dict:
    return {k[len("mtp."):]: v for k, v in tensors.items()}


@pytest.fixture(scope="module")
def mtp_dirs(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    """The same target and the same head in each place a head can be, the target without a head
    ("none"), and a multimodal-layout target with its own head ("wrapper")."""
    root = tmp_path_factory.mktemp("mtp")
    base = root / "none"
    build_tiny_qwen3_5(base, seed=21, tokenizer_dir=tokenizer_dir)
    text_config = json.loads((base / "config.json").read_text())
    head = random_mtp_head(text_config, seed=5)
    dirs = {"none": base}
    for name in SOURCES + ("declared-mlx",):
        dirs[name] = root / name
        shutil.copytree(base, dirs[name])
    add_to_shard(dirs["shards"], head)
    write_mtp_sidecar(dirs["hf-sidecar"] / "mtp.safetensors", head)
    write_mtp_sidecar(dirs["mlx-sidecar"] / "mtp.safetensors", head, mlx=True)
    # an MTPLX-style checkpoint: the config declares the sidecar (which a torch tool saved: no MLX metadata)
    declared = dirs["declared-mlx"]
    sidecar = write_mtp_sidecar(declared / "extra" / "head.safetensors", head, mlx=True)
    save_file(load_file(str(sidecar)), str(sidecar), metadata={"format": "pt"})
    config = dict(text_config, mlx_lm_extra_tensors={"mtp_file": "extra/head.safetensors", "mtp_tensor_count": 15})
    (declared / "config.json").write_text(json.dumps(config))
    # the multimodal layout of the real releases: text under model.language_model.*, head at top-level mtp.*
    wrapper = root / "wrapper"
    build_tiny_qwen3_5(wrapper, wrapper=True, seed=22, tokenizer_dir=tokenizer_dir, tie_word_embeddings=True)
    add_to_shard(wrapper, random_mtp_head(json.loads((wrapper / "config.json").read_text())["text_config"], seed=6))
    dirs["wrapper"] = wrapper
    return dirs


@pytest.fixture(scope="module")
def plain(mtp_dirs):
    """The target in float64 (no argmax near-ties), its prompts and plain greedy outputs."""
    engine = load_engine(str(mtp_dirs["none"]), dtype="float64", device="cpu", prefill_step_size=PREFILL_STEP)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    outputs = [engine.generate_all(ids, greedy(NEW_TOKENS)).token_ids for ids in prompts]
    return engine, prompts, outputs


def head_for(engine: Engine, model_dir: Path):
    head = load_mtp_head(model_dir, engine.model)
    assert head is not None
    return head


def sequence_logits(head, engine: Engine, ids: list[int]) -> torch.Tensor:
    """The head's logits [n-1, V] over a whole sequence from scratch: row i pairs h_i with ids[i+1]."""
    with torch.no_grad():
        h = engine.model(torch.tensor([ids]), torch.arange(len(ids))[None], engine.model.make_cache(len(ids))).hidden
        cache = KVCache(head.cache_specs(), len(ids), h.dtype, h.device)
        rows = head(torch.tensor([ids[1:]]), h[:, :-1], torch.arange(len(ids) - 1)[None], cache)
        return head.logits(rows)[0]


# ---- the head --------------------------------------------------------------------------------------
def test_head_matches_transformers_layers(mtp_dirs):
    """Our head against one assembled from transformers' Qwen3.5 modules (RMSNorm with 1 + w,
    the full-attention decoder layer, its rotary embedding), float32, one pass over 12 rows:
    checks the embedding-first concatenation, every norm and the layer."""
    from transformers import Qwen3_5ForCausalLM as HFQwen3_5ForCausalLM
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer as HFLayer
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    hf = HFQwen3_5ForCausalLM.from_pretrained(str(mtp_dirs["none"]), dtype=torch.float32).eval()
    config = hf.config
    config._attn_implementation = "eager"
    target = load_model(mtp_dirs["hf-sidecar"], torch.float32, torch.device("cpu"))
    ours = load_mtp_head(mtp_dirs["hf-sidecar"], target)
    tensors = strip_head(load_file(str(mtp_dirs["hf-sidecar"] / "mtp.safetensors")))
    full = config.layer_types.index("full_attention")
    layer = HFLayer(config, full).eval()
    layer.load_state_dict({k[len("layers.0."):]: v for k, v in tensors.items() if k.startswith("layers.0.")})
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = Qwen3_5RMSNorm(config.hidden_size, config.rms_norm_eps)
        norms[name].weight.data.copy_(tensors[f"{name}.weight"])
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (1, 12), generator=gen)
    hidden = torch.randn(1, 12, config.hidden_size, generator=gen)
    positions = torch.arange(12)[None]
    with torch.no_grad():
        e = hf.model.embed_tokens(ids)
        x = torch.cat((norms["pre_fc_norm_embedding"](e), norms["pre_fc_norm_hidden"](hidden)), -1) @ tensors["fc.weight"].T
        mask = torch.full((12, 12), float("-inf")).triu(1)[None, None]
        x = layer(x, hf.model.rotary_emb(x, positions[None].expand(3, 1, 12)), attention_mask=mask)
        ref = hf.lm_head(norms["norm"](x))
        got = ours.logits(ours(ids, hidden, positions, KVCache(ours.cache_specs(), 12, torch.float32, "cpu")))
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)  # measured 6e-7; a swapped cat: 3.9


def test_head_shares_the_targets_embedding_and_lm_head(plain, mtp_dirs):
    engine = plain[0]
    head = head_for(engine, mtp_dirs["hf-sidecar"])
    names = {n for n, _ in head.named_parameters()}
    assert not any("embed_tokens" in n or "lm_head" in n for n in names)
    assert head.target is engine.model


# ---- where the weights are -------------------------------------------------------------------------
def test_head_in_shards_leaves_the_backbone_loading_alone(mtp_dirs, monkeypatch):
    """model.safetensors with mtp.* inside: the backbone loads the same (the head's tensors are
    skipped with the debug line), and the head loads from the shard."""
    lines = []
    monkeypatch.setattr("verispec.loading.model_loader.log.debug", lambda msg, *a: lines.append(msg % a))
    with_head = load_model(mtp_dirs["shards"], torch.float64, torch.device("cpu"))
    without = load_model(mtp_dirs["none"], torch.float64, torch.device("cpu"))
    for (name, a), (_, b) in zip(with_head.named_parameters(), without.named_parameters()):
        assert torch.equal(a, b), name
    ignored = [line for line in lines if "ignored" in line]
    assert len(ignored) == 1 and "ignored 15 checkpoint tensors" in ignored[0] and "mtp." in ignored[0]
    head = load_mtp_head(mtp_dirs["shards"], with_head)
    sidecar = load_mtp_head(mtp_dirs["hf-sidecar"], without)
    for (name, a), (_, b) in zip(head.named_parameters(), sidecar.named_parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("prefix", ["model.", "model.language_model.", "language_model."])
def test_wrapper_prefixes_in_shards(mtp_dirs, tmp_path, prefix):
    d = tmp_path / "m"
    shutil.copytree(mtp_dirs["none"], d)
    tensors = load_file(str(mtp_dirs["hf-sidecar"] / "mtp.safetensors"))
    add_to_shard(d, {prefix + k: v for k, v in tensors.items()})
    target = load_model(d, torch.float64, torch.device("cpu"))
    head = load_mtp_head(d, target)
    ref = load_mtp_head(mtp_dirs["hf-sidecar"], target)
    for (name, a), (_, b) in zip(head.named_parameters(), ref.named_parameters()):
        assert torch.equal(a, b), name


def test_head_tensor_names():
    assert head_tensor_name("mtp.fc.weight", sidecar=False) == "fc.weight"
    assert head_tensor_name("model.language_model.mtp.norm.weight", sidecar=False) == "norm.weight"
    assert head_tensor_name("language_model.mtp.layers.0.mlp.up_proj.weight", sidecar=False) == \
        "layers.0.mlp.up_proj.weight"
    assert head_tensor_name("model.language_model.layers.0.mlp.up_proj.weight", sidecar=False) is None
    assert head_tensor_name("model.visual.blocks.0.attn.qkv.weight", sidecar=False) is None
    assert head_tensor_name("fc.weight", sidecar=True) == "fc.weight"  # a sidecar holds only the head


@pytest.mark.parametrize("sidecar", ["mtp/weights.safetensors", "model-mtp.safetensors"])
def test_other_sidecar_names(mtp_dirs, tmp_path, sidecar):
    d = tmp_path / "m"
    shutil.copytree(mtp_dirs["none"], d)
    write_mtp_sidecar(d / sidecar, strip_head(load_file(str(mtp_dirs["hf-sidecar"] / "mtp.safetensors"))))
    target = load_model(d, torch.float64, torch.device("cpu"))
    head = load_mtp_head(d, target)
    ref = load_mtp_head(mtp_dirs["hf-sidecar"], target)
    assert head.norm_convention is NormConvention.HF
    for (name, a), (_, b) in zip(head.named_parameters(), ref.named_parameters()):
        assert torch.equal(a, b), name


# ---- the norm convention ---------------------------------------------------------------------------
def test_hf_and_mlx_sidecars_of_one_head_compute_the_same_logits(plain, mtp_dirs):
    """The same head saved both ways (HF: w, applied as 1 + w; MLX: 1 + w stored, metadata
    format=mlx; or a config declaring mlx_lm_extra_tensors): identical logits, every norm of
    the head (q/k norms included) following the file's convention."""
    engine, prompts, outputs = plain
    ids = prompts[1] + outputs[1]
    ref = sequence_logits(head_for(engine, mtp_dirs["hf-sidecar"]), engine, ids)
    for source in ("mlx-sidecar", "declared-mlx"):
        head = head_for(engine, mtp_dirs[source])
        assert head.norm_convention is NormConvention.MLX
        norms = [m for m in head.modules() if isinstance(m, RMSNorm)]
        assert len(norms) == 7 and not any(m.unit_offset for m in norms)
        assert torch.equal(sequence_logits(head, engine, ids), ref), source
    assert all(m.unit_offset for m in head_for(engine, mtp_dirs["shards"]).modules() if isinstance(m, RMSNorm))


def test_the_wrong_convention_changes_the_logits(plain, mtp_dirs, tmp_path):
    """Decided by the format, never by the values: the MLX file without its metadata is read as HF
    (every norm shifted twice), the HF file under a config declaring mlx_lm_extra_tensors as MLX
    (never shifted); both change the logits."""
    engine, prompts, outputs = plain
    ids = prompts[1] + outputs[1]
    ref = sequence_logits(head_for(engine, mtp_dirs["hf-sidecar"]), engine, ids)
    stripped = tmp_path / "stripped"
    shutil.copytree(mtp_dirs["mlx-sidecar"], stripped)
    f = stripped / "mtp.safetensors"
    save_file(load_file(str(f)), str(f))  # no metadata
    declared = tmp_path / "declared"
    shutil.copytree(mtp_dirs["hf-sidecar"], declared)
    config = json.loads((declared / "config.json").read_text())
    (declared / "config.json").write_text(json.dumps(dict(config, mlx_lm_extra_tensors={"mtp_file": "mtp.safetensors"})))
    for d, convention in ((stripped, NormConvention.HF), (declared, NormConvention.MLX)):
        head = head_for(engine, d)
        assert head.norm_convention is convention
        assert (sequence_logits(head, engine, ids) - ref).abs().max() > 0.1


# ---- missing and broken heads ----------------------------------------------------------------------
def test_missing_head_is_logged_and_decoding_goes_on(plain, mtp_dirs, monkeypatch):
    engine, prompts, outputs = plain
    lines = []
    monkeypatch.setattr(mtp_module.log, "warning", lambda msg, *a: lines.append(msg % a))
    spec = load_engine(str(mtp_dirs["none"]), dtype="float64", device="cpu", prefill_step_size=PREFILL_STEP,
                       mtp=True)
    assert spec.proposer is None
    assert len(lines) == 1
    assert "no MTP head" in lines[0] and "model.safetensors" in lines[0] and "mtp/weights.safetensors" in lines[0]
    result = spec.generate_all(prompts[0], greedy(NEW_TOKENS))
    assert result.token_ids == outputs[0] and result.stats.method == "ar"


def test_mtp_on_a_model_without_a_head_architecture(tiny_models, monkeypatch):
    lines = []
    monkeypatch.setattr(mtp_module.log, "warning", lambda msg, *a: lines.append(msg % a))
    d = tiny_models.get("mtp-llama", "llama")
    spec = load_engine(str(d), dtype="float32", device="cpu", mtp=True)
    assert spec.proposer is None
    assert len(lines) == 1 and "model type 'llama' has no MTP head" in lines[0]
    assert spec.generate_all([1, 2, 3], greedy(4)).stats.method == "ar"


def test_incomplete_or_misshapen_head_is_refused(plain, mtp_dirs, tmp_path):
    engine = plain[0]
    tensors = strip_head(load_file(str(mtp_dirs["hf-sidecar"] / "mtp.safetensors")))
    d = tmp_path / "m"
    shutil.copytree(mtp_dirs["none"], d)
    write_mtp_sidecar(d / "mtp.safetensors", {k: v for k, v in tensors.items() if k != "layers.0.self_attn.k_norm.weight"})
    with pytest.raises(VerispecError, match=r"missing tensors: mtp\.layers\.0\.self_attn\.k_norm\.weight"):
        load_mtp_head(d, engine.model)
    write_mtp_sidecar(d / "mtp.safetensors", dict(tensors, **{"fc.weight": torch.zeros(64, 64)}))
    with pytest.raises(VerispecError, match=r"'mtp\.fc\.weight'.*shape \(64, 64\).*\(64, 128\)"):
        load_mtp_head(d, engine.model)
    # quantized tensors in a float checkpoint: nothing says how they were quantized
    write_mtp_sidecar(d / "mtp.safetensors", dict(tensors, **{"fc.scales": torch.zeros(64, 2)}))
    with pytest.raises(VerispecError, match=r"quantized \(it has \.scales tensors\).*no MLX `quantization` section"):
        load_mtp_head(d, engine.model)


# ---- lossless speculation --------------------------------------------------------------------------
@pytest.mark.parametrize("source", SOURCES)
def test_identity_random_head(plain, mtp_dirs, source):
    """--mtp greedy == plain greedy, token for token, at depths 1..3, through Engine.load."""
    engine, prompts, outputs = plain
    for depth in (1, 2, 3):
        spec = load_engine(str(mtp_dirs[source]), dtype="float64", device="cpu", prefill_step_size=PREFILL_STEP,
                           mtp=True, num_draft_tokens=depth)
        assert isinstance(spec.proposer, MtpProposer) and spec.num_drafts == depth
        for i, ids in enumerate(prompts):
            result = spec.generate_all(ids, greedy(NEW_TOKENS))
            assert result.token_ids == outputs[i], f"{source} depth={depth} prompt {i}"
            assert result.stats.method == "mtp"
            assert 0 < result.stats.drafted <= depth * result.stats.rounds


def test_identity_wrapper_checkpoint(mtp_dirs):
    """The layout of the real releases (qwen3_5, text under model.language_model.*, tied lm_head,
    mtp.* at the top level), with --mtp-hidden pre-norm as well."""
    d = str(mtp_dirs["wrapper"])
    base = load_engine(d, dtype="float64", device="cpu", prefill_step_size=PREFILL_STEP)
    ids = base.tokenizer.encode(PROMPTS[1])
    expected = base.generate_all(ids, greedy(NEW_TOKENS)).token_ids
    for hidden in ("post-norm", "pre-norm"):
        spec = load_engine(d, dtype="float64", device="cpu", prefill_step_size=PREFILL_STEP, mtp=True,
                           num_draft_tokens=2, mtp_hidden=hidden)
        assert spec.proposer.hidden is MtpHidden(hidden)
        result = spec.generate_all(ids, greedy(NEW_TOKENS))
        assert result.token_ids == expected and result.stats.method == "mtp" and result.stats.drafted > 0


class ScriptedMtp(MtpProposer):
    """The real MTP proposer (head, paged drafter rows, in-round rows overwritten) whose drafts are
    replaced by a script: the target's own continuation, right where right(index, chain_position)
    says. Records the head's logits at every draft, to be checked against the head run from
    scratch on the committed sequence: its rows must hold exactly the committed ones, whatever
    was accepted. Drives one sequence at a time."""

    def __init__(self, head, continuation, vocab_size, right, hidden=MtpHidden.POST_NORM):
        super().__init__(head, hidden)
        self.continuation, self.vocab_size, self.right = continuation, vocab_size, right
        self.prompt_len = 0
        self.records: list[tuple[int, list[int], list[torch.Tensor]]] = []
        self.features: dict[int, torch.Tensor] = {}  # position -> the target feature observed there

    def start(self, seq):
        super().start(seq)
        self.prompt_len = len(seq.prompt_ids)

    def observe(self, rows):
        super().observe(rows)
        for _, step in rows:
            features = step.hidden if self.hidden is MtpHidden.POST_NORM else step.pre_norm
            for i, row in enumerate(features):
                self.features[step.start_position + i] = row.clone()

    def propose(self, seqs, num_drafts, params, generators):
        assert len(seqs) == 1
        self._logits = []
        self._next_position = self._states[seqs[0].id].next_position
        drafts = super().propose(seqs, num_drafts, params, generators)
        self.records.append((self._next_position, drafts[0].token_ids, self._logits))
        return drafts

    def _choose_rows(self, logits, params, generators, active):
        j = len(self._logits)
        self._logits.append(logits[0].clone())
        index = self._next_position + 1 + j - self.prompt_len  # the draft's index in the continuation
        token = self.continuation[index] if index < len(self.continuation) else 0
        token = token if self.right(index, j) else (token + 1) % self.vocab_size
        return torch.tensor([token], device=logits.device), [None]


def check_records(proposer: ScriptedMtp, sequence: list[int]) -> None:
    """Each recorded draft's head logits == the head run from scratch over the committed sequence
    (the target features observed at positions 0..p-1, each with the token after it), then chained
    on the drafts before it (fed back after mtp.norm). The features are the ones the engine passed:
    the target's own numbers depend on its pass shapes (its SSM state is kept in float32)."""
    head = proposer.head
    # observed in order up to every draft's position at least (the rows of a last round that drafted
    # nothing are never observed: the sequence finished)
    observed = sorted(proposer.features)
    assert observed == list(range(len(observed))) and len(observed) <= len(sequence) - 1
    assert all(next_position <= len(observed) for next_position, _, _ in proposer.records)
    features = torch.stack([proposer.features[i] for i in observed])[None]
    with torch.no_grad():
        for next_position, drafts, logits in proposer.records:
            cache = KVCache(head.cache_specs(), next_position + len(drafts) + 1, torch.float64, "cpu")
            rows = head(torch.tensor([sequence[1:next_position + 1]]), features[:, :next_position],
                        torch.arange(next_position)[None], cache)
            cache.commit(next_position)
            fed = rows[:, -1:]
            for j, got in enumerate(logits):
                torch.testing.assert_close(got, head.logits(fed[0, -1]), atol=1e-9, rtol=1e-9,
                                           msg=f"draft {j} at position {next_position}")
                fed = head(torch.tensor([[drafts[j]]]), fed, torch.tensor([[next_position + j]]), cache)
                cache.commit(1)


_rng = random.Random(3)
SCATTERED = [_rng.random() < 0.7 for _ in range(NEW_TOKENS)]  # fixed, without a period
PATTERNS = {  # right(continuation index, position in the chain); depth 3 -> verify passes of 4
    "always-right": (lambda i, j: True, {4}),
    "always-wrong": (lambda i, j: False, {1}),
    "reject-first": (lambda i, j: j != 0, {1}),
    "reject-second": (lambda i, j: j != 1, {2}),
    "reject-third": (lambda i, j: j != 2, {3}),
    "scattered": (lambda i, j: SCATTERED[i % len(SCATTERED)], {1, 2, 3, 4}),
}


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_rejection_at_every_chain_position(plain, mtp_dirs, pattern, monkeypatch):
    """Depth 3 with scripted drafts: rejection at each position of the chain (and none, and all)
    rolls back the target's recurrent state and the head's in-round rows; the output is plain
    greedy and the head always drafts from exactly the committed rows (pre-norm features for the
    scattered pattern)."""
    engine, prompts, outputs = plain
    head = head_for(engine, mtp_dirs["hf-sidecar"])
    right, expected_commits = PATTERNS[pattern]
    verify_commits = Counter()
    commit = BatchCache.commit

    def recording_commit(cache, num_rows):
        if cache.positions.shape[1] == 4:  # the target's verify passes (one sequence)
            verify_commits[num_rows[0]] += 1
        commit(cache, num_rows)

    monkeypatch.setattr(BatchCache, "commit", recording_commit)
    for i in (1, 0):
        hidden = MtpHidden.PRE_NORM if pattern == "scattered" else MtpHidden.POST_NORM
        proposer = ScriptedMtp(head, outputs[i], engine.model.vocab_size, right, hidden)
        result = spec_engine(engine, proposer, 3).generate_all(prompts[i], greedy(NEW_TOKENS))
        assert result.token_ids == outputs[i], f"{pattern} prompt {i}"
        assert result.stats.method == "mtp"
        if pattern == "always-right":
            assert result.stats.accepted == result.stats.drafted
        elif pattern in ("always-wrong", "reject-first"):
            assert result.stats.accepted == 0
        else:
            assert 0 < result.stats.accepted < result.stats.drafted
        check_records(proposer, prompts[i] + outputs[i])
    assert set(verify_commits) == expected_commits, verify_commits


def train_head(engine: Engine, head, prompts: list[list[int]], steps: int = 300, seed: int = 0) -> None:
    """Distil the target into the head on its greedy continuations of `prompts`: every row i
    (h_i, t_{i+1}) learns the target's own distribution of t_{i+2} (soft labels), as a real MTP head
    approximates it. Its drafts are then accepted part of the time, and its q overlaps p without
    equalling it (what the sampling test needs to mean anything)."""
    sequences = [ids + engine.generate_all(ids, greedy(NEW_TOKENS)).token_ids for ids in prompts]
    batches = []
    with torch.no_grad():
        for seq in sequences:
            out = engine.model(torch.tensor([seq]), torch.arange(len(seq))[None], engine.model.make_cache(len(seq)))
            soft = torch.softmax(engine.model.logits(out.hidden[0, 1:-1]), -1)  # p(t_{i+2} | t_{<=i+1})
            batches.append((torch.tensor([seq[1:-1]]), out.hidden[:, :-2], soft))
    torch.manual_seed(seed)
    params = list(head.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=3e-3)
    for step in range(steps):
        tokens, hidden, labels = batches[step % len(batches)]
        cache = KVCache(head.cache_specs(), tokens.shape[1], hidden.dtype, hidden.device)
        logits = head.logits(head(tokens, hidden, torch.arange(tokens.shape[1])[None], cache))
        loss = torch.nn.functional.cross_entropy(logits[0], labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    for p in params:
        p.requires_grad_(False)


def first_tokens(engine: Engine, ids: list[int], k: int = 4) -> tuple[list[int], torch.Tensor]:
    """The target's k most likely next tokens after `ids` and their top-k (temperature 1) probabilities."""
    with torch.no_grad():
        hidden = engine.model(torch.tensor([ids]), torch.arange(len(ids))[None], engine.model.make_cache(len(ids))).hidden
        top = torch.topk(engine.model.logits(hidden[0, -1]).double(), k)
    return top.indices.tolist(), torch.softmax(top.values, -1)


@pytest.fixture(scope="module")
def trained(plain, mtp_dirs):
    engine, prompts, _ = plain
    head = head_for(engine, mtp_dirs["shards"])
    text = corpus_text(20_000)
    held_out = [engine.tokenizer.encode(text[i:i + 200]) for i in range(1000, 20_000, 3000)]
    # and prompt 0 followed by each of its 4 likeliest first tokens: the sampling test drafts there
    branches = [prompts[0] + [a] for a in first_tokens(engine, prompts[0])[0]]
    train_head(engine, head, held_out + branches)
    return head, held_out


@pytest.mark.slow  # kept out of `make test` for time; `make test-slow` (and CI) runs it
def test_identity_trained_head_with_partial_acceptance(plain, trained):
    engine, prompts, outputs = plain
    head, held_out = trained
    cases = list(zip(prompts, outputs))
    cases += [(ids, engine.generate_all(ids, greedy(NEW_TOKENS)).token_ids) for ids in held_out[:2]]
    accepted = drafted = 0
    for depth in (1, 2, 3):
        spec = spec_engine(engine, MtpProposer(head), depth)
        for i, (ids, expected) in enumerate(cases):
            result = spec.generate_all(ids, greedy(NEW_TOKENS))
            assert result.token_ids == expected, f"depth={depth} case {i}"
            accepted += result.stats.accepted
            drafted += result.stats.drafted
    # both branches of verification ran, at every depth
    assert 0 < accepted < drafted, (accepted, drafted)


@pytest.mark.slow  # kept out of `make test` for time; `make test-slow` (and CI) runs it
def test_sampling_keeps_the_target_distribution(plain, trained):
    """End to end with the (trained) MTP head drafting from q = its processed distribution: the
    pair (first token, second token) follows the target's processed distribution p(a) p(b | a).
    The first token comes from prefill, the second is the first verified one (its draft accepted
    or rejected, both happen). top_k = 4 keeps the support at 16 pairs for a chi-square test."""
    engine, prompts, _ = plain
    head, _ = trained
    ids = prompts[0]
    params = dict(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True)
    cells, probs = {}, []
    for a, pa in zip(*first_tokens(engine, ids)):
        seconds, p_second = first_tokens(engine, ids + [a])
        for b, pb in zip(seconds, p_second):
            cells[(a, b)] = len(probs)
            probs.append(pa * pb)
    joint = torch.stack(probs)
    spec = spec_engine(engine, MtpProposer(head), 1)
    counts: Counter = Counter()
    n, accepted = 500, 0
    for seed in range(n):
        result = spec.generate_all(ids, SamplingParams(seed=seed, **params))
        assert result.stats.drafted == 1
        accepted += result.stats.accepted
        counts[cells[tuple(result.token_ids[:2])]] += 1
    assert 0 < accepted < n, accepted
    assert chi_square(counts, joint, n) < 37.70  # 15 degrees of freedom, p = 0.001


# ---- configuration and CLI -------------------------------------------------------------------------
def run_cli(*commands: list[str]) -> list[tuple[int, str, str]]:
    """Run `verispec ARGS` commands side by side (each is mostly interpreter start-up);
    returns (exit status, stdout, stderr) for each."""
    procs = [subprocess.Popen([sys.executable, "-m", "verispec", *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={"HF_HUB_OFFLINE": "1", "PATH": ""})
             for args in commands]
    outputs = [p.communicate() for p in procs]
    return [(p.returncode, *out) for p, out in zip(procs, outputs)]


@pytest.mark.slow  # kept out of `make test` for time; `make test-slow` (and CI) runs it
def test_cli_generate_json_reports_mtp(mtp_dirs):
    common = ["generate", "-m", str(mtp_dirs["hf-sidecar"]), "--prompt", "def f", "--max-tokens", "9", "--json",
              "--dtype", "float64"]
    (spec_code, spec_out, spec_err), (base_code, base_out, base_err) = run_cli(common + ["--mtp", "--mtp-depth", "2"],
                                                                               common)
    assert spec_code == 0 and base_code == 0, spec_err + base_err
    out, ref = json.loads(spec_out), json.loads(base_out)
    assert out["token_ids"] == ref["token_ids"] and out["text"] == ref["text"]
    assert out["stats"]["method"] == "mtp" and ref["stats"]["method"] == "ar"
    assert out["stats"]["drafted"] > 0


@pytest.mark.slow  # kept out of `make test` for time; `make test-slow` (and CI) runs it
def test_cli_mtp_without_a_head_logs_why_and_generates(mtp_dirs):
    [(code, stdout, stderr)] = run_cli(["generate", "-m", str(mtp_dirs["none"]), "--prompt", "def f",
                                        "--max-tokens", "5", "--json", "--mtp"])
    assert code == 0, stderr
    lines = [line for line in stderr.splitlines() if line.strip() and "start-up:" not in line]
    assert len(lines) == 1 and "no MTP head" in lines[0] and "decoding without speculation" in lines[0], lines
    out = json.loads(stdout)
    assert out["stats"]["method"] == "ar" and len(out["token_ids"]) == 5


@pytest.mark.parametrize("args, message", [
    (["--mtp", "--mtp-depth", "0"], "--num-draft-tokens must be >= 1, got 0"),
    (["--mtp", "--eagle3", "/nowhere"], "--mtp and --eagle3 are two proposers; use one of them"),
    (["--mtp-depth", "2"], "--num-draft-tokens sets the drafts per round: it needs a proposer (--eagle3 DIR, --mtp, "
                           "--suffix or --ngram)"),
    (["--mtp-hidden", "pre-norm"], "--mtp-hidden needs --mtp"),
])
def test_cli_bad_mtp_flags_are_one_line(mtp_dirs, capsys, args, message):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for command in ("generate", "serve"):
        extra = ["--prompt", "x"] if command == "generate" else ["--port", str(port)]
        code = cli_main([command, "-m", str(mtp_dirs["hf-sidecar"]), *extra, *args])
        err = capsys.readouterr().err
        assert code == 2 and err.splitlines() == [f"verispec: error: {message}"], err


def test_cli_bad_mtp_hidden_is_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["generate", "-m", "x", "--prompt", "x", "--mtp", "--mtp-hidden", "middle"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.splitlines()) == 1
    assert "--mtp-hidden" in err and "post-norm" in err and "pre-norm" in err


def test_engine_config_checks(mtp_dirs):
    with pytest.raises(VerispecError, match="--mtp-hidden 'middle' is not supported"):
        load_engine(str(mtp_dirs["hf-sidecar"]), mtp=True, mtp_hidden="middle")
    with pytest.raises(VerispecError, match="--num-draft-tokens must be >= 1"):
        load_engine(str(mtp_dirs["hf-sidecar"]), mtp=True, num_draft_tokens=0)
    with pytest.raises(VerispecError, match="two proposers"):
        load_engine(str(mtp_dirs["hf-sidecar"]), mtp=True, eagle3="/nowhere")
