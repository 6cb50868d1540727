"""Prompt datasets: procedural arithmetic, and local JSONL/Parquet files in question/answer layout."""

from rlnb.data.prompts import ArithmeticTask, Problem, load_qa_file

__all__ = ["ArithmeticTask", "Problem", "load_qa_file"]
