"""Medusa speculation as a plan: the tree, the heads' checkpoint layout and the rules. Pure.

Medusa (NxDI `is_medusa=True`) puts `num_medusa_heads` extra LM heads on the target: head i reads
the target's final (normed) hidden state at position p and proposes the token at p + 2 + i, one
more than the target's own next token. Each round, the target scores a token tree of
`medusa_speculation_length` N nodes in one step (`nxdi.core.planning.token_tree`): the root is
the row's last emitted token, and a node at depth d is the `choice`-th best proposal of head d-1.
The target accepts the longest path its own greedy tokens agree with and adds its own next token.

Heads' checkpoint (NxDI's `<model dir>/medusa_heads.pt`, loaded with `weights_only=True`), per
head i, the keys of `nn.Sequential(ResBlock(E), Linear(E, V, bias=False))`:

    medusa_head_{i}.0.linear.weight  [E, E]   the ResBlock (x + SiLU(W x + b))
    medusa_head_{i}.0.linear.bias    [E]
    medusa_head_{i}.1.weight         [V, E]   the head's LM layer

`MedusaPlan` is the static part every Medusa program shares (graph-affecting: it comes from
NeuronSpec fields). `rule_problems` and `cpu_problems` are the configuration rules (run by
`nxdi.core.config.neuron_checks` and `nxdi.core.config.cpu_support`), `model_problems` the ones
that need the model's vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs
from returns.result import Failure, Result, Success

from nxdi.core.config.neuron_spec import NeuronSpec
from nxdi.core.errors import ConfigError, Problem
from nxdi.core.model_spec import ModelSpec
from nxdi.core.planning import buckets, token_tree
from nxdi.core.planning.token_tree import TokenTree

HEADS_FILE = "medusa_heads.pt"
"""The heads' file in the model directory (NxDI's name)."""

Shape = tuple[int, ...]


def head_keys(i: int) -> tuple[str, str, str]:
    """Head i's checkpoint keys: ResBlock weight, ResBlock bias, LM weight."""
    return f"medusa_head_{i}.0.linear.weight", f"medusa_head_{i}.0.linear.bias", f"medusa_head_{i}.1.weight"


def head_names(num_heads: int) -> tuple[str, ...]:
    """Every head key, head by head (the order programs bind them in)."""
    return tuple(k for i in range(num_heads) for k in head_keys(i))


def head_shapes(num_heads: int, *, hidden: int, vocab: int) -> dict[str, Shape]:
    """Every head key with its shape, head by head (the order programs bind them in)."""
    out: dict[str, Shape] = {}
    for i in range(num_heads):
        res_w, res_b, lm = head_keys(i)
        out |= {res_w: (hidden, hidden), res_b: (hidden,), lm: (vocab, hidden)}
    return out


@attrs.frozen(kw_only=True)
class MedusaPlan:
    """The static part of a Medusa model's programs."""

    num_heads: int = attrs.field(validator=attrs.validators.gt(0))
    tree: TokenTree
    """The padded tree (N = medusa_speculation_length nodes)."""

    @property
    def nodes(self) -> int:
        """N, the tokens a tree step scores per row."""
        return self.tree.nodes

    @property
    def top_k(self) -> int:
        """K, the candidates each head returns (best first): what the tree's choices index."""
        return self.tree.top_k

    @property
    def emitted(self) -> int:
        """The most tokens one tree step emits per row: its deepest path plus the target's own token."""
        return self.tree.depth + 1


def plan_for(spec: NeuronSpec) -> Result[MedusaPlan, ConfigError]:
    """The Medusa plan of `spec` (is_medusa=True).

    Returns:
        The plan, or the ConfigError of the tree (`token_tree.tree_problems`) or of a missing tree.
    """
    if spec.medusa_tree is None:
        fix = "set medusa_tree to a list of paths (e.g. medusa_mc_sim_7b_63.json)"
        return Failure(ConfigError.of("medusa_tree", None, "is required with is_medusa=True", fix))
    tree = token_tree.parse_token_tree(
        spec.medusa_tree,
        nodes=max(spec.medusa_speculation_length, 1),
        max_depth=spec.num_medusa_heads,
        field="medusa_tree",
        nodes_field="medusa_speculation_length",
        depth_field="num_medusa_heads",
    )
    return tree.map(lambda t: MedusaPlan(num_heads=max(spec.num_medusa_heads, 1), tree=t))


def tree_table_for(spec: NeuronSpec) -> Result[buckets.BucketTable, ConfigError]:
    """The tree programs' bucket table: the token-generation lengths on `max_length`, a bucket
    selected for a row's first node position plus N (batch `spec_batch_size`)."""
    return buckets.speculation_table(
        max_length=spec.max_length,
        batch_size=spec.spec_batch_size,
        enable_bucketing=spec.enable_bucketing,
        speculation_length=spec.medusa_speculation_length,
        buckets=spec.token_generation_buckets,
    )


_OTHER_SPECULATION = (
    ("speculation_length", lambda s: s.speculation_length > 0, 0),
    ("enable_fused_speculation", lambda s: s.enable_fused_speculation, False),
    ("enable_eagle_speculation", lambda s: s.enable_eagle_speculation, False),
    ("token_tree_config", lambda s: s.token_tree_config is not None, None),
)


def rule_problems(s: NeuronSpec) -> Iterator[Problem]:
    """The rules of a Medusa configuration (nothing when is_medusa is False): another speculation
    method beside it, a missing or malformed tree (not prefix-closed, deeper than num_medusa_heads,
    more nodes than medusa_speculation_length), and a tree step longer than the cache."""
    if not s.is_medusa:
        return
    for name, on, default in _OTHER_SPECULATION:
        if on(s):
            why = "is another speculation method: it cannot run with Medusa (is_medusa=True)"
            yield Problem.of(name, getattr(s, name), why, f"set {name}={default!r}, or is_medusa=False")
    if s.medusa_speculation_length <= 0 or s.num_medusa_heads <= 0:
        return  # neuron_checks reports these
    match plan_for(s):
        case Failure(err):
            yield from err.problems
    if s.medusa_speculation_length >= s.max_length:
        why = f"must be less than max_length={s.max_length}: a tree step writes that many cache slots after the prompt"
        yield Problem.of("medusa_speculation_length", s.medusa_speculation_length, why, "raise seq_len")


def cpu_problems(s: NeuronSpec) -> Iterator[Problem]:
    """What Medusa does not run with on the CPU engine yet: tensor parallelism (the heads are not
    sharded), flash decoding, and the block KV layout (the tree programs use the contiguous cache)."""
    if not s.is_medusa:
        return
    for name, value, on, default in (
        ("tp_degree", s.tp_degree, s.tp_degree > 1, 1),
        ("flash_decoding_enabled", s.flash_decoding_enabled, s.flash_decoding_enabled, False),
        ("is_block_kv_layout", s.is_block_kv_layout, s.is_block_kv_layout, False),
    ):
        if on:
            why = "does not run with Medusa (is_medusa=True) on the CPU engine yet"
            yield Problem.of(name, value, why, f"set {name}={default!r}, or is_medusa=False")


def model_problems(model: ModelSpec, s: NeuronSpec) -> Iterator[Problem]:
    """The rules that need the model: every head returns top_k candidates out of the vocabulary."""
    if not s.is_medusa:
        return
    match plan_for(s):
        case Success(plan) if plan.top_k > model.vocab_size:
            why = f"asks for top-{plan.top_k} candidates per head, more than the vocabulary ({model.vocab_size})"
            yield Problem.of("medusa_tree", len(plan.tree.paths), why, "use smaller choice indices")
