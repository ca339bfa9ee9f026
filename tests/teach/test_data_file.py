"""llmlab.teach.data_file: a notebook's data found from any working folder (a student's copy of
a notebook elsewhere), a data/ folder beside the notebook first."""
import pytest

from llmlab.teach import data_file
from llmlab.teach.data import KIT_DATA

NAME = "h200_decode_attention_2026-11-29.json"


def test_found_from_any_working_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert data_file(NAME) == KIT_DATA / NAME and data_file(NAME).is_file()


def test_a_data_folder_beside_the_notebook_comes_first(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / NAME).write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert data_file(NAME) == tmp_path / "data" / NAME


def test_a_missing_file_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="beside this notebook"):
        data_file("no_such_file.json")
