"""Every code example of the transformers-neuronx developer guide, run as written on nxdi.

The examples (`tests/support/tnx_guide_examples.py`, verbatim) import `transformers_neuronx`, which
the optional compat distribution provides (`compat/transformers_neuronx`, re-exporting
`nxdi.shell.tnx`; the `compat_package` fixture puts it on sys.path). The only change made to an
example is its hub ids, replaced by tiny local checkpoints (with a local word tokenizer) of the
family the example names. Examples that name a family's own class (GPT-2, BLOOM) run for each
runnable record of that family; examples that only load a checkpoint through
`NeuronAutoModelForCausalLM` run on Llama too. Models are built at the tensor-parallel degree an
example names (tp_degree=8: eight rank processes), hence a tier of its own (`make test-examples`).
"""

from __future__ import annotations

import contextlib
import io
import os
import string
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from nxdi.core import families
from nxdi.core.families.record import FamilyRecord
from nxdi.effects.distributed.ranks import free_port
from nxdi.testing import checkpoints
from nxdi.testing.word_tokenizer import word_tokenizer
from tests.support import tnx_guide_examples as guide
from tests.support.processes import outputs_of

REPO = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("one_torch_thread")

LLAMA = families.by_model_type()["llama"]
GPT2 = [r for r in families.runnable() if "gpt2" in r.model_types]
BLOOM = [r for r in families.runnable() if "bloom" in r.model_types]
GENERIC = [LLAMA, *GPT2]
"""Records an example that only loads a checkpoint (NeuronAutoModelForCausalLM) runs on."""

_LONG = {"gpt2": {"n_positions": 4096}}
"""Config overrides that let a tiny checkpoint hold the guide's 2048-3072 positions (default: max_position_embeddings)."""


def _ids(records: list[FamilyRecord]) -> list[str]:
    return [r.name for r in records]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """Tiny checkpoint folder of a family (with a tokenizer), built once per module."""
    made: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in made:
            overrides = _LONG.get(name, {"max_position_embeddings": 4096})
            path, hf = checkpoints.build_checkpoint(
                tmp_path_factory.mktemp(name), name, checkpoints.SaveFormat.SAFETENSORS, **overrides
            )
            word_tokenizer(hf.config.vocab_size).save_pretrained(path)
            made[name] = str(path)
        return made[name]

    return get


def _bpe_tokenizer(vocab_size: int) -> transformers.PreTrainedTokenizerFast:
    """A BPE tokenizer (metaspace, as Llama's) trained on the guide's speculative prompt, in the form
    `LlamaTokenizer.from_pretrained` reads: the example loads its tokenizer with that class."""
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=list(string.printable[:94])
    )
    core.train_from_iterator(["Hello, I'm a generative AI language model."] * 4, trainer=trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.fixture
def run_example(
    compat_package: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., tuple[dict[str, Any], str]]]:
    """exec an example with `hub ids -> local folders` replaced; returns its namespace and stdout."""
    monkeypatch.chdir(tmp_path)  # the examples save to relative folders

    def run(text: str, paths: dict[str, str]) -> tuple[dict[str, Any], str]:
        for hub_id, path in paths.items():
            assert f"'{hub_id}'" in text or f'"{hub_id}"' in text, hub_id
            text = text.replace(f"'{hub_id}'", repr(path)).replace(f'"{hub_id}"', repr(path))
        namespace: dict[str, Any] = {"__name__": "__guide_example__"}
        out = io.StringIO()
        with contextlib.redirect_stdout(out), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the settings without CPU effect are reported; tested elsewhere
            exec(compile(text, "<guide example>", "exec"), namespace)
        return namespace, out.getvalue()

    yield run


@pytest.mark.parametrize("record", GENERIC, ids=_ids(GENERIC))
def test_compile_time_configurations(run_example: Any, checkpoint: Any, record: FamilyRecord) -> None:
    ns, _ = run_example(guide.COMPILE_TIME, {"gpt2": checkpoint(record.name)})
    spec = ns["model"].nxdi_model.spec
    assert (spec.batch_size, spec.seq_len, spec.tp_degree, spec.torch_dtype) == (1, 128, 2, "float16")
    assert spec.context_encoding_buckets == (64,) and ns["model"].nxdi_model.is_loaded_to_neuron
    ns["model"].nxdi_model.close()


@pytest.mark.parametrize("record", BLOOM, ids=_ids(BLOOM))
def test_automatic_model_selection(run_example: Any, checkpoint: Any, record: FamilyRecord) -> None:
    paths = {"bigscience/bloom-560m": checkpoint(record.name), "openlm-research/open_llama_3b_v2": checkpoint("llama")}
    ns, _ = run_example(guide.AUTO_MODEL, paths)
    assert type(ns["bloom"]).__name__ == "BloomForSampling" and type(ns["llama"]).__name__ == "LlamaForSampling"


@pytest.mark.parametrize("record", GPT2, ids=_ids(GPT2))
@pytest.mark.parametrize(
    "example",
    [guide.HF_GENERATE, guide.INT8, guide.PARALLEL_CONTEXT, guide.PROMPT_BATCH, guide.SERIALIZATION],
    ids=["hf-generate", "int8", "parallel-context", "prompt-batch", "serialization"],
)
def test_gpt2_examples(run_example: Any, checkpoint: Any, record: FamilyRecord, example: str) -> None:
    ns, _ = run_example(example, {"gpt2": checkpoint(record.name)})
    assert ns["generated_sequence"].shape[-1] > 0
    if example is guide.INT8:  # the weights are stored int8 (the model's own quantized checkpoint)
        assert ns["model"].nxdi_model.spec.quantized and ns["model"].nxdi_model.spec.quantization_dtype == "int8"


def test_presharded_weights(run_example: Any, checkpoint: Any) -> None:
    ns, _ = run_example(guide.PRESHARDED, {"openlm-research/open_llama_3b": checkpoint("llama")})
    saved = Path("llama-artifacts")
    assert (saved / "weights" / "tp7_sharded_checkpoint.safetensors").is_file() and (saved / "config.json").is_file()
    model = ns["model_neuron_presharded"]
    assert model.nxdi_model.is_loaded_to_neuron and Path(model.nxdi_model.checkpoint_path) == saved.resolve()
    ids = torch.tensor([[1, 5, 7, 9]])
    expected = checkpoints.build_model("llama", max_position_embeddings=4096).generate(
        ids, max_length=12, do_sample=False
    )
    torch.testing.assert_close(model.sample(ids, 12, top_k=1), expected)
    model.nxdi_model.close()


def test_mistral_gqa(run_example: Any, checkpoint: Any) -> None:
    ns, _ = run_example(guide.MISTRAL_GQA, {"mistralai/Mistral-7B-Instruct-v0.2": checkpoint("mistral")})
    prompt = ns["encoded_input"].input_ids
    out = ns["generated_sequence"]
    assert out.shape[0] == 1 and out.shape[1] <= 256 and torch.equal(out[:, : prompt.shape[1]], prompt)
    assert ns["model_neuron"].nxdi_model.spec.torch_dtype == "bfloat16"


def test_on_device_top_k(run_example: Any, checkpoint: Any) -> None:
    ns, _ = run_example(guide.ON_DEVICE_TOP_K, {"openlm-research/open_llama_3b": checkpoint("llama")})
    sampling = ns["model_neuron"].nxdi_model.spec.on_device_sampling_config
    assert (sampling.top_k, sampling.top_p, sampling.temperature, sampling.do_sample) == (10, 0.9, 0.9, True)
    assert ns["generated_sequence"].shape[-1] > ns["encoded_input"].input_ids.shape[-1]
    ns["model_neuron"].nxdi_model.close()


def test_dynamic_per_batch_line(run_example: Any, checkpoint: Any) -> None:
    """As written, the example tokenizes two prompts of different lengths without `padding=True`,
    which transformers' tokenizers refuse (with the real Llama tokenizer too); the test pads them."""
    example = guide.DYNAMIC_PER_BATCH_LINE.replace(
        "encoded_input = tokenizer(text, return_tensors='pt')",
        "encoded_input = tokenizer(text, return_tensors='pt', padding=True)",
    )
    assert example != guide.DYNAMIC_PER_BATCH_LINE
    ns, _ = run_example(example, {"openlm-research/open_llama_3b": checkpoint("llama")})
    model = ns["model_neuron"]
    assert model.nxdi_model.spec.on_device_sampling_config.dynamic
    assert model._rows == [[1.0, 1.0, 1.0], [20.0, 0.9, 0.9]]  # the update took effect per row
    assert ns["generated_sequence"].shape[0] == 2
    model.nxdi_model.close()


def test_streamer(run_example: Any, checkpoint: Any) -> None:
    ns, printed = run_example(guide.STREAMER, {"mistralai/Mistral-7B-Instruct-v0.2": checkpoint("mistral")})
    new = ns["generated_sequence"].shape[1] - ns["encoded_input"].input_ids.shape[1]
    assert len(ns["streamer"].token_latencies) == new > 0
    assert printed.count("Iteration") == new and "First 10 token latencies" in printed


def test_stopping_criteria(run_example: Any, checkpoint: Any) -> None:
    ns, printed = run_example(guide.STOPPING_CRITERIA, {"mistralai/Mistral-7B-Instruct-v0.2": checkpoint("mistral")})
    steps = len(ns["streamer"].token_latencies)
    room = 256 - ns["encoded_input"].input_ids.shape[1]
    assert 0 < steps <= room and printed.count("Iteration") == steps
    at_eos = f"Token tensor([[{ns['tokenizer'].eos_token_id}]])" in printed.splitlines()[-1]
    assert "Stopping!" in printed or at_eos or steps == room  # the criterion, EOS, or sequence_length


@pytest.mark.parametrize(
    ("example", "attribute", "value"),
    [
        (guide.FUSE_QKV, "fuse_qkv", True),
        (guide.ATTENTION_LAYOUT, "attention_layout", "BSH"),
        (guide.SHARD_OVER_SEQUENCE, "shard_over_sequence", True),
    ],
    ids=["fuse-qkv", "attention-layout", "shard-over-sequence"],
)
def test_neuron_config_snippets(run_example: Any, example: str, attribute: str, value: Any) -> None:
    ns, _ = run_example("from transformers_neuronx import NeuronConfig\n" + example, {})
    assert getattr(ns["neuron_config"], attribute) == value


@pytest.mark.parametrize("record", GENERIC, ids=_ids(GENERIC))
def test_bucketing(run_example: Any, checkpoint: Any, record: FamilyRecord) -> None:
    ns, _ = run_example(
        "from transformers_neuronx import NeuronAutoModelForCausalLM\n" + guide.BUCKETING,
        {"gpt2": checkpoint(record.name)},
    )
    spec = ns["model"].nxdi_model.spec
    assert spec.token_generation_buckets == (128, 256, 512, 1024, 2048, 3072) and spec.seq_len == 3072
    assert spec.context_encoding_buckets == (1024, 1280, 1536, 1792, 2048) and spec.max_context_length == 2048


def test_speculative_sampling(run_example: Any, tmp_path: Path) -> None:
    paths = {}
    for hub_id, seed in (("openlm-research/open_llama_3b", 0), ("openlm-research/open_llama_13b", 1)):
        path, _ = checkpoints.build_checkpoint(
            tmp_path / str(seed), "llama", checkpoints.SaveFormat.SAFETENSORS, seed=seed
        )
        _bpe_tokenizer(160).save_pretrained(path)
        paths[hub_id] = str(path)
    ns, printed = run_example(guide.SPECULATIVE, paths)
    response, prompt = ns["response"], ns["input_ids"]
    assert response.shape == (1, 30) and torch.equal(response[:, : prompt.shape[1]], prompt) and prompt.shape[1] > 3
    stats = ns["spec_gen"].stats
    assert stats["target_steps"] < stats["emitted"]  # speculation ran: more tokens than target steps
    assert "Decoded tokens:" in printed
    for model in (ns["draft_neuron_model"], ns["target_neuron_model"]):
        model.nxdi_model.close()


def test_multi_node_tensor_parallel_script(compat_package: Path, checkpoint: Any, tmp_path: Path) -> None:
    """The guide's multi-node tensor-parallel run: its script on two "nodes" (processes on localhost)
    with NEURON_RT_ROOT_COMM_ID, NEURON_RANK_ID and NEURON_LOCAL_TP. Two changes besides the hub id,
    both of the guide's own instructions or this machine's size: the guide's tp_degree=32 (64 over two
    nodes) becomes 2 (one rank per node: this machine has 2 cores), and `torch.manual_seed(0)` comes
    first, as the guide says to set it so that every node samples the same tokens."""
    text = guide.MULTI_NODE_SCRIPT.replace("tp_degree=32", "tp_degree=2")
    text = text.replace('"openlm-research/open_llama_3b"', repr(checkpoint("llama")))
    script = tmp_path / "multi_node_dev_example.py"
    script.write_text("import torch\ntorch.manual_seed(0)\n" + text)
    port = free_port()
    procs = []
    for node in (0, 1):
        variables = {"NEURON_RT_ROOT_COMM_ID": f"127.0.0.1:{port}", "NEURON_RANK_ID": str(node), "NEURON_LOCAL_TP": "1"}
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(compat_package), str(REPO)]), **variables}
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script)],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = outputs_of(procs, timeout=300, what="the two nodes")
    printed = [out.strip().splitlines()[-1] for out in outputs]
    assert printed[0] == printed[1], outputs  # both nodes print the same sample
    assert len(printed[0].split()) == 256, printed[0]  # max_length=256 tokens, decoded (pads included)
