"""A calculator agent that needs nothing but Python's standard library: the tests run it in a fresh,
empty virtualenv (no slime_async, no SDK), as a program of its own that reaches the endpoint only
over HTTP. Its session comes in the environment (`OPENAI_BASE_URL`, `OPENAI_API_KEY`, `SLIME_TASK`);
it prints its reward last. With `fail` in the task's metadata it exits 3; with `hang` it never ends."""

import json
import os
import sys
import time
import urllib.request

task = json.loads(sys.stdin.read())
assert task == json.loads(os.environ["SLIME_TASK"])
if task.get("metadata", {}).get("fail"):
    sys.exit("the agent fell over")
if task.get("metadata", {}).get("hang"):
    time.sleep(3600)


def chat(messages: list) -> dict:
    body = json.dumps({"model": "policy", "messages": messages, "tools": [{"type": "function", "function": {
        "name": "calculate", "parameters": {"type": "object"}}}]}).encode()
    request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=body, headers={
        "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
    with urllib.request.urlopen(request) as resp:
        return json.load(resp)["choices"][0]["message"]


messages = [{"role": "user", "content": task["prompt"]}]
reply = chat(messages)
for call in reply.get("tool_calls") or []:
    expression = json.loads(call["function"]["arguments"])["expression"]
    result = eval(expression, {"__builtins__": {}})  # the test's own fixed expression, never a model's in real use
    messages += [reply, {"role": "tool", "tool_call_id": call["id"], "content": str(result)}]
    reply = chat(messages)
print("the agent's own log line")
print(1.0 if str(task["answer"]) in (reply.get("content") or "") else 0.0)
