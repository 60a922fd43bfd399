"""The reinforcement-learning examples learn: PPO's return on CartPole-v1 and
DDPG's on Pendulum-v1 rise within a few thousand environment steps, and a run
resumes from its checkpoint (actor, critic, optimizers; for DDPG also the
target networks and the replay buffer)."""

import re

import pytest

from _helpers import run_example

pytestmark = pytest.mark.slow


def run(script, *flags):
    return run_example(f"reinforcement_learning/{script}", *flags)


def numbers(pattern, text):
    return [float(x) for x in re.findall(pattern, text)]


def test_ppo_return_rises_and_resumes(tmp_path):
    tiny = ["--n_steps", 32, "--per_device_batch_size", 32, "--workdir", tmp_path]  # rollouts of 8 x 32 steps
    first = run("ppo.py", "--total_steps", 3072, *tiny)
    assert "8 devices, mesh {'data': 4, 'model': 2}" in first
    start = numbers(r"rollout 0: .* mean return \(last 20 episodes\) ([0-9.]+)", first)[0]  # ~20: random policy
    second = run("ppo.py", "--total_steps", 6144, "--resume", *tiny)
    assert "resumed from update 240, rollout 12" in second, second[-2000:]  # 12 rollouts x 10 epochs x 2 minibatches
    assert "rollout 0:" not in second and "rollout 23:" in second
    final = numbers(r"final mean return \(last 20 training episodes\): ([0-9.]+)", second)[0]
    assert final >= max(2.5 * start, 50), (start, second[-2000:])
    assert (tmp_path / "returns.png").stat().st_size > 0


def test_ddpg_return_rises(tmp_path):
    out = run("ddpg.py", "--total_steps", 4800, "--learning_starts", 1600, "--workdir", tmp_path)
    returns = numbers(r"mean return \(last 10 episodes\) (-?[0-9.]+)", out)  # one per round of 8 x 200 steps
    assert len(returns) == 3, out[-2000:]  # -1214, -1026, -370 on 2026-11-26
    assert returns[-1] > returns[0] + 300, returns  # random actions score about -1200
    greedy = numbers(r"noiseless policy: mean return (-?[0-9.]+)", out)[0]
    assert greedy > -700, (returns, greedy)
    assert (tmp_path / "returns.png").stat().st_size > 0
    assert any((tmp_path / "checkpoints").iterdir())
