'''The README snippet "Use it with Hugging Face xLSTM", run as written.

``SNIPPET`` is the block for the README section of that title, character for character; once
the section is in README.md, the second test holds the two together (and tests/test_readme.py's
``_section_code("Use it with Hugging Face xLSTM")`` runs the README's copy the same way).
'''
import pathlib
import re

import pytest

pytest.importorskip("transformers", minversion="5.7")

SECTION = "Use it with Hugging Face xLSTM"
SNIPPET = """\
import torch
import compileops.integrations.transformers as cit
from transformers import xLSTMConfig, xLSTMForCausalLM

config = xLSTMConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_heads=2)
model = xLSTMForCausalLM(config)
cit.apply(model)  # each mLSTM cell + multi-head norm + output gate -> compileops.mlstm
ids = torch.randint(0, 128, (2, 32))

optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
loss = model.train()(ids, labels=ids).loss  # parallel form (kernel="auto"), no cache
loss.backward()
optimizer.step()

out = model.eval().generate(ids[:, :8], max_new_tokens=8, do_sample=False)
print(out[:, 8:])  # prefill: chunkwise, states in xLSTMCache; each token: compileops.mlstm_step
"""


def test_snippet_runs():
    namespace = {}
    exec(compile(SNIPPET, "README.md", "exec"), namespace)
    assert namespace["out"].shape[0] == 2 and namespace["out"].shape[1] > 8
    assert namespace["loss"].isfinite()


def test_readme_section_is_the_snippet():
    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    if f"## {SECTION}\n" not in readme:
        pytest.skip(f"README.md has no '## {SECTION}' section yet")
    section = readme.split(f"## {SECTION}\n", 1)[1].split("\n## ", 1)[0]
    assert "\n".join(re.findall(r"```python\n(.*?)```", section, re.S)) == SNIPPET
