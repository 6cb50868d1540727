"""Tools in the model's chat template and the sandbox code runs in: schemas checked, calls parsed, results rendered as
the template's tool messages, code run under CPU, wall, memory, file and network limits (each a test that
fails where the limit is not there), the ``code_tests`` reward, and bad settings refused naming the key."""

import re
import socket
import time

import pytest

from rlnb.algorithms.tools import ChatTools, check_tool_schema, parse_tool_calls, register_tool
from rlnb.config import RecipeError, load_recipe
from rlnb.config.sections_lm import SandboxConfig
from rlnb.errors import ConfigError
from rlnb.models.lm import TINY_CHAT_TEMPLATE, build_char_tokenizer
from rlnb.sandbox import run_python


def test_the_sandbox_runs_code_and_holds_it_to_each_limit():
    assert run_python("print(6 * 7)").stdout == "42\n"
    t0 = time.monotonic()
    spin = run_python("while True: pass", SandboxConfig(cpu_s=1, wall_s=30))
    assert spin.returncode == -9 and not spin.timed_out and time.monotonic() - t0 < 10, spin  # CPU seconds
    t0 = time.monotonic()
    sleeper = run_python("import time; time.sleep(30)", SandboxConfig(wall_s=0.5))
    assert sleeper.timed_out and sleeper.text() == "error: timed out" and time.monotonic() - t0 < 5
    assert (
        run_python("x = bytearray(2 * 1024**3)", SandboxConfig(memory_mb=256)).text() == "error: MemoryError"
    )
    big = run_python("open('f', 'w').write('a' * 3 * 2**20)", SandboxConfig(file_mb=1))
    assert "File too large" in big.text(), big
    with socket.socket() as server:  # a port listening on this host's loopback: unreachable from inside
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        out = run_python(
            f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); print('in')"
        )
    assert out.stdout == "" and "Network is unreachable" in out.text(), out
    seen = run_python("import os; print(sorted(os.environ), os.listdir('.'))").stdout
    assert (
        "PATH" in seen and "PYTHONPATH" not in seen and "[]" in seen
    )  # a bare environment, an empty directory
    assert len(run_python("print('x' * 10**5)", SandboxConfig(output_chars=100)).stdout) < 200
    with pytest.raises(ConfigError, match=r"reward.sandbox.cpu_s: expected an integer in \[1, 3600\]"):
        run_python("print(1)", SandboxConfig(cpu_s=0))


def test_tool_schemas_are_checked_and_calls_parsed_in_the_hermes_format():
    good = {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a"]}}}  # fmt: skip
    assert check_tool_schema(good) is good
    for bad, why in (
        ({"name": "add"}, 'is {"type": "function"'),
        ({"type": "function", "function": {"name": "two words"}}, "names its function with an identifier"),
        (
            {**good, "function": {**good["function"], "parameters": {"type": "array"}}},
            "gives its parameters as",
        ),
        (
            {
                **good,
                "function": {
                    **good["function"],
                    "parameters": {"type": "object", "properties": {}, "required": ["x"]},
                },
            },
            "requires only",
        ),
    ):
        with pytest.raises(ConfigError, match=re.escape(f"rollout.tools: a tool schema {why}")):
            check_tool_schema(bad)
    text = ('first <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call> then <tool_call>\n{"name": "x", '
            '"arguments": "{\\"q\\": 2}"}\n</tool_call> <tool_call>{nope</tool_call>')  # fmt: skip
    calls = parse_tool_calls(text)
    assert calls[:2] == [("add", {"a": 1}), ("x", {"q": 2})] and calls[2].startswith(
        "error: the tool call is not JSON"
    )
    assert parse_tool_calls("no call here") == []


def test_chat_tools_run_the_call_and_answer_in_the_templates_own_tool_message():
    tok = build_char_tokenizer()
    tok.chat_template = TINY_CHAT_TEMPLATE

    @register_tool({"type": "function", "function": {"name": "shout", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}}}})  # fmt: skip
    def shout(text: str) -> str:
        return text.upper()

    tools = ChatTools(["python", "shout"], tok)
    prompt = tok.apply_chat_template([{"role": "user", "content": "6*7="}], tools=tools.schemas(), tokenize=False,
                                     add_generation_prompt=True)  # fmt: skip
    assert prompt == "<bos>Tools: python, shout\nQ: 6*7=\nA: "
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(6*7)"}}</tool_call>'
    # the reply: the template's tool message after the model's EOS, the assistant's next turn opened
    assert tools(call) == "R: 42\nA: "
    whole = tok.apply_chat_template([{"role": "user", "content": "6*7="}, {"role": "assistant", "content": call},
                                     {"role": "tool", "content": "42"}], tools=tools.schemas(), tokenize=False,
                                    add_generation_prompt=True)  # fmt: skip
    assert whole == prompt + call + tok.eos_token + tools(
        call
    )  # token in, token out: the template's own text
    assert tools('<tool_call>{"name": "shout", "arguments": {"text": "hi"}}</tool_call>') == "R: HI\nA: "
    assert tools("the answer is 42") is None  # no call: the final answer
    assert (
        tools('<tool_call>{"name": "nope", "arguments": {}}</tool_call>')
        == "R: error: no tool named 'nope'\nA: "
    )
    assert tools('<tool_call>{"name": "shout", "arguments": {"x": 1}}</tool_call>').startswith("R: error: ")
    assert tools('<tool_call>{"name": "python", "arguments": {"code": "1/0"}}</tool_call>') == (
        "R: error: ZeroDivisionError: division by zero\nA: "
    )
    plain = build_char_tokenizer()
    # a template that leaves tool messages out
    plain.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'tool' %}{{ m['content'] }}{% endif %}{% endfor %}"
    )
    with pytest.raises(
        ConfigError, match="rollout.tools: the model's chat template does not render a tool message"
    ):
        ChatTools(["python"], plain)


def test_the_code_tests_reward_runs_the_completions_code_with_the_records_tests_in_the_sandbox():
    from rlnb.components.lm import RewardWorker

    reward = RewardWorker(fn="code_tests", fields=("tests",), sandbox=SandboxConfig(wall_s=2))
    fenced = "Here:\n```python\ndef add(a, b):\n    return a + b\n```"
    tests = {"tests": "assert add(2, 3) == 5"}
    wrong = "```python\ndef add(a, b):\n    return a - b\n```"
    forever = "```python\ndef add(a, b):\n    while True: pass\n```"
    scores = reward.score(
        [fenced, wrong, forever, "def add(a, b): return a + b"], [""] * 4, None, [tests] * 4
    )
    assert scores == [1.0, 0.0, 0.0, 1.0]


def test_tool_settings_that_cannot_work_are_refused_naming_the_key():
    base = ["data.chat_template=true", "rollout.max_turns=2"]
    with pytest.raises(
        RecipeError, match=r"rollout.tools: \['pyton'\] are not registered tools; registered: "
    ):
        load_recipe("grpo_arith", [*base, "rollout.tools=[pyton]"])
    with pytest.raises(RecipeError, match="rollout.tools: the model is shown its tools by its chat template"):
        load_recipe("grpo_arith", ["rollout.max_turns=2", "rollout.tools=[python]"])
    with pytest.raises(RecipeError, match="rollout.tools: a tool's answer is read in the model's next turn"):
        load_recipe("grpo_arith", ["data.chat_template=true", "rollout.tools=[python]"])
    with pytest.raises(RecipeError, match="rollout.interaction: 'calculator' and rollout.tools both answer"):
        load_recipe("grpo_arith", [*base, "rollout.tools=[python]", "rollout.interaction=calculator"])
    with pytest.raises(RecipeError, match=r"reward.sandbox.memory_mb: expected an integer in \[64, 65536\]"):
        load_recipe("grpo_arith", ["reward.sandbox.memory_mb=1"])
    with pytest.raises(ConfigError, match="register_tool: a tool schema"):
        register_tool({"type": "function", "function": {"name": "1bad"}})
    assert load_recipe("grpo_arith", [*base, "rollout.tools=[python]"]).rollout.tools == ["python"]


CALL = '<tool_call>{{"name": "python", "arguments": {{"code": "print({a}{op}{b})"}}}}</tool_call>'


# (600 warm-start steps: 45 s alone, 140 s inside the suite, past 300 on a loaded machine; fewer steps, at a
# higher rate or not, left some seeds' model calling the tool wrongly)
@pytest.mark.timeout(900)
def test_a_tiny_model_trained_here_calls_the_python_tool_in_its_template_on_workers(cluster, tmp_path):
    """``grpo_calculator`` with ``rollout.tools=[python]`` and the chat template: the multi-turn warm start teaches
    the tiny model to call the tool with the problem's product (the sandbox's answer rendered in the template's tool
    message between its turns, as in training); held out, it calls it, the tool answers in the transcript, and GRPO
    steps train on the two-turn transcripts."""
    from rlnb.algorithms.tools import parse_tool_calls
    from rlnb.loop import GRPOLoop

    recipe = load_recipe("grpo_calculator", {
        "actor.model_path": str(tmp_path / "model"), "actor.tiny_lm.max_positions": 256, "rollout.interaction": None,
        "rollout.tools": ["python"], "data.chat_template": True, "data.sft_turns": [CALL, "{answer}"],
        "data.sft_noise": 0.0, "data.sft_noise_turns": None, "rollout.max_new_tokens": 80, "actor.sft_steps": 600,
        "runner.steps": 2, "runner.eval_interval": 0, "data.eval_size": 8, "runner.tensorboard": False,
    })  # fmt: skip
    with GRPOLoop.from_recipe(recipe, cluster=cluster, run_dir=tmp_path / "run") as loop:
        assert loop.task.held_out[0].prompt.startswith("<bos>Tools: python\nQ: ")  # shown by the template
        loop.sft(progress=False)
        loop.evaluate(8)
        right = 0
        for prompt, text, _ in loop.last_samples:
            a, b = map(int, prompt.rsplit("Q: ", 1)[1].split("=")[0].split("*"))
            calls = parse_tool_calls(text)
            right += (
                calls == [("python", {"code": f"print({a}*{b})"})] and f"</tool_call>R: {a * b}\nA: " in text
            )
        assert right >= 6, loop.last_samples  # (of the 8 shown: the call, and the sandbox's answer after it)
        records = loop.run(progress=False)
    assert len(records) == 2 and all(r["rollout/turns_mean"] > 1.5 for r in records), records
