"""`--model random-llama3-8b --tokenizer DIR` (model/random_weights.py): random weights in a
real model's shape, the vocabulary cut to the tokenizer's, so the server runs on a GPU
without a model hub. On a CPU the 8B is refused; random-llama3-tiny is the same path in a
few MB, which these tests run."""
from __future__ import annotations

import pytest

import llmlab
from llmlab import cli
from llmlab.model.random_weights import LLAMA3_8B, random_shape

EMBEDDED_VOCAB = 49152     # the embedded SmolLM2's tokenizer


@pytest.fixture(scope="module")
def tiny():
    return llmlab.LLM("random-llama3-tiny", tokenizer="embedded", device="cpu", num_gpu_blocks=64)


def test_the_vocabulary_is_the_tokenizers(tiny):
    assert tiny.engine.model_config.vocab_size == tiny.tokenizer.vocab_size == EMBEDDED_VOCAB
    assert tiny.engine.model_config.num_layers == 2
    assert tiny.tokenizer.eos_token_id in tiny.engine.runner.eos_token_ids


def test_text_in_text_out(tiny):
    out = tiny.generate("the cat sat", llmlab.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and isinstance(out.text, str)
    assert out.token_ids == tiny.generate("the cat sat", llmlab.SamplingParams(
        max_tokens=5, temperature=0.0, ignore_eos=True))[0].token_ids   # greedy: the same again


def test_the_8b_shape_follows_a_tokenizer(tiny):
    hf = random_shape("random-llama3-8b", tiny.tokenizer)
    assert hf["vocab_size"] == EMBEDDED_VOCAB and hf["hidden_size"] == LLAMA3_8B["hidden_size"] == 4096
    assert hf["num_hidden_layers"] == 32 and hf["eos_token_id"] == tiny.tokenizer.eos_token_id
    assert random_shape("random-llama3-8b")["vocab_size"] == 128256     # no tokenizer: Llama-3's


def test_the_8b_is_refused_on_a_cpu():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        llmlab.LLM("random-llama3-8b", tokenizer="embedded", device="cpu")


def test_serve_refuses_the_8b_on_a_cpu_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--model", "random-llama3-8b", "--tokenizer", "embedded", "--device", "cpu"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "needs a CUDA device" in err and "random-llama3-tiny" in err and "Traceback" not in err


def test_a_tokenizer_that_is_not_there_is_refused():
    with pytest.raises(ValueError, match="does not exist"):
        llmlab.LLM("random-llama3-tiny", tokenizer="no/such/folder", device="cpu")


def test_a_folder_of_tokenizer_files_alone_is_a_tokenizer(tiny, tmp_path):
    """--tokenizer DIR takes what `save_pretrained` writes of a tokenizer (no config.json: no
    model), as vLLM's --tokenizer does; a folder with neither is refused by name."""
    tiny.tokenizer.hf.save_pretrained(tmp_path / "tok")
    assert not (tmp_path / "tok" / "config.json").exists()
    llm = llmlab.LLM("random-llama3-tiny", tokenizer=str(tmp_path / "tok"), device="cpu", num_gpu_blocks=64)
    assert llm.engine.model_config.vocab_size == EMBEDDED_VOCAB
    assert llm.tokenizer.encode("Hello world") == tiny.tokenizer.encode("Hello world")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no tokenizer.json or tokenizer_config.json"):
        llmlab.LLM("random-llama3-tiny", tokenizer=str(tmp_path / "empty"), device="cpu", num_gpu_blocks=64)
