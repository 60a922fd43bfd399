"""Proximal Policy Optimization (PPO) on gymnasium's CartPole-v1: an actor and
a critic, each with its own optimizer, updated by one compiled redeqx step.

    python examples/reinforcement_learning/ppo.py                     # 8 simulated CPU devices
    python examples/reinforcement_learning/ppo.py --n_model_shards 1 --per_device_batch_size 32
    python examples/reinforcement_learning/ppo.py --workdir runs/ppo  # + checkpoints, TensorBoard, returns.png
    python examples/reinforcement_learning/ppo.py --workdir runs/ppo --resume
    tensorboard --logdir runs/ppo

The loop is yours: collect a rollout from vectorised environments on the host
(the policy's forward pass compiled and sharded), compute advantages (GAE),
then run a few epochs of minibatch updates over the rollout.
"""

import argparse
import functools
import os

# On a machine with no accelerator, pretend to have 8 devices (must precede `import jax`).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import equinox as eqx  # noqa: E402
import gymnasium as gym  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import redeqx  # noqa: E402


def act_fn(models, batch, key):
    """Sample an action for each environment; keep its log-probability and the state's value."""
    logits = jax.vmap(models["actor"])(batch["obs"])  # (n_envs, n_actions)
    action = jax.random.categorical(key, logits)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits), action[:, None], 1)[:, 0]
    return {"action": action, "logp": logp, "value": jax.vmap(models["critic"])(batch["obs"])}


def greedy_fn(models, batch, key):
    return jax.vmap(models["actor"])(batch["obs"]).argmax(-1)


def collate_fn(examples):
    return {k: np.stack([e[k] for e in examples]) for k in examples[0]}


def actor_loss(actor, batch, key, *, clip, ent_coef):  # the clipped surrogate; batch["advantage"] normalised
    adv = batch["advantage"]
    logp_all = jax.nn.log_softmax(jax.vmap(actor)(batch["obs"]))  # (B, n_actions)
    logp = jnp.take_along_axis(logp_all, batch["action"][:, None], 1)[:, 0]
    ratio = jnp.exp(logp - batch["logp"])
    surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - clip, 1 + clip) * adv)
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, -1).mean()
    clipped = jnp.mean(jnp.abs(ratio - 1) > clip)
    return -surrogate.mean() - ent_coef * entropy, {"entropy": entropy, "clip_fraction": clipped}


def critic_loss(critic, batch, key):
    return 0.5 * jnp.mean((jax.vmap(critic)(batch["obs"]) - batch["ret"]) ** 2)


def make_ppo_step(actor_opt, critic_opt, clip, ent_coef):
    def ppo_step(state, batch):
        adv = batch["advantage"]
        batch = {**batch, "advantage": (adv - adv.mean()) / (adv.std() + 1e-8)}  # over the whole (sharded) minibatch
        a_loss_fn = functools.partial(actor_loss, batch=batch, key=None, clip=clip, ent_coef=ent_coef)
        (a_loss, aux), a_grads = eqx.filter_value_and_grad(a_loss_fn, has_aux=True)(state["actor"].model)
        c_loss, c_grads = eqx.filter_value_and_grad(critic_loss)(state["critic"].model, batch, None)
        new_state = {"actor": redeqx.apply_gradients(state["actor"], a_grads, actor_opt),
                     "critic": redeqx.apply_gradients(state["critic"], c_grads, critic_opt)}
        return new_state, {"actor_loss": a_loss, "critic_loss": c_loss, **aux}

    return ppo_step


def collect(envs, act, models, obs, n_steps, key, gamma, lam):
    """n_steps of every environment -> (transitions with GAE advantages, next obs, finished episodes' returns)."""
    rows, returns = [], []
    for t in range(n_steps):
        out = jax.device_get(act(models, {"obs": obs}, jax.random.fold_in(key, t)))
        next_obs, reward, term, trunc, info = envs.step(out["action"])
        if trunc.any():  # cut by the time limit, not ended: bootstrap from the value of the state it stopped in
            final = next_obs.copy()
            final[trunc] = np.stack(info["final_obs"][trunc])
            reward = reward + gamma * trunc * np.asarray(act(models, {"obs": final}, key)["value"])
        rows.append({"obs": obs, "reward": reward, "done": term | trunc, **out})
        returns += list(info["episode"]["r"][info["_episode"]]) if "episode" in info else []
        obs = next_obs
    next_value = np.asarray(act(models, {"obs": obs}, key)["value"])
    advantage, transitions = 0.0, []
    for row in reversed(rows):  # generalised advantage estimation, backwards in time
        not_done = 1.0 - row["done"]
        delta = row["reward"] + gamma * next_value * not_done - row["value"]
        advantage = delta + gamma * lam * not_done * advantage
        next_value = row["value"]
        transitions += [{"obs": row["obs"][i], "action": row["action"][i].astype(np.int32), "logp": row["logp"][i],
                         "advantage": np.float32(advantage[i]), "ret": np.float32(advantage[i] + row["value"][i])}
                        for i in range(len(row["obs"]))]
    return transitions, obs, returns


def evaluate_greedy(greedy, models, n_envs, seed):
    """One episode per environment with the most probable action; the mean return."""
    envs = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * n_envs)
    obs, _ = envs.reset(seed=seed)
    total, alive = np.zeros(n_envs), np.ones(n_envs, bool)
    while alive.any():
        obs, reward, term, trunc, _ = envs.step(np.asarray(greedy(models, {"obs": obs}, jax.random.key(0))))
        total += reward * alive
        alive &= ~(term | trunc)
    return total.mean()


def log(*args):
    if jax.process_index() == 0:  # every process runs this script; one of them speaks
        print(*args, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n_model_shards", type=int, default=2)
    parser.add_argument("--per_device_batch_size", type=int, default=64, help="minibatch = this x data devices")
    parser.add_argument("--total_steps", type=int, default=100_000, help="environment steps, all envs together")
    parser.add_argument("--n_envs", type=int, default=8, help="a multiple of the data devices")
    parser.add_argument("--n_steps", type=int, default=64, help="steps per environment per rollout")
    parser.add_argument("--update_epochs", type=int, default=10)
    parser.add_argument("--learning_rate", type=float, default=1e-3, help="decays linearly to 0")
    parser.add_argument("--gamma", type=float, default=0.98)
    parser.add_argument("--gae_lambda", type=float, default=0.8)
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument("--ent_coef", type=float, default=0.0)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", help="checkpoints, logs and returns.png go here")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --workdir")
    args = parser.parse_args()
    if args.resume and not args.workdir:
        parser.error("--resume needs --workdir")

    key = jax.random.key(args.seed)
    actor_key, critic_key, actor_state_key, critic_state_key, rollout_key, data_key = jax.random.split(key, 6)
    # Every process (redeqx.launch, several hosts) steps these same environments from the same seed, so the
    # observations each passes to the compiled steps are the same global batch.
    envs = gym.wrappers.vector.RecordEpisodeStatistics(gym.vector.SyncVectorEnv(
        [lambda: gym.make("CartPole-v1")] * args.n_envs, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP))
    n_obs, n_actions = envs.single_observation_space.shape[0], int(envs.single_action_space.n)

    mesh = redeqx.make_mesh(args.n_model_shards)
    actor = eqx.nn.MLP(n_obs, n_actions, args.hidden, depth=2, activation=jnp.tanh, key=actor_key)
    critic = eqx.nn.MLP(n_obs, "scalar", args.hidden, depth=2, activation=jnp.tanh, key=critic_key)
    minibatch = args.per_device_batch_size * mesh.shape["data"]
    batch = {k: jax.ShapeDtypeStruct((minibatch, *shape), dtype) for k, shape, dtype in (  # a minibatch's shapes
        ("obs", (n_obs,), jnp.float32), ("action", (), jnp.int32), ("logp", (), jnp.float32),
        ("advantage", (), jnp.float32), ("ret", (), jnp.float32))}
    a_loss_fn = functools.partial(actor_loss, clip=args.clip, ent_coef=args.ent_coef)
    specs = {"actor": redeqx.sharding_rules(actor, mesh, loss_fn=a_loss_fn, batch=batch, name="actor"),
             "critic": redeqx.sharding_rules(critic, mesh, loss_fn=critic_loss, batch=batch, name="critic")}
    log(f"{len(jax.devices())} devices, mesh {dict(mesh.shape)}")
    log(redeqx.explain(actor, specs["actor"], mesh, loss_fn=a_loss_fn, batch=batch))

    rollout_size = args.n_envs * args.n_steps
    n_iters = args.total_steps // rollout_size
    n_updates = n_iters * args.update_epochs * (rollout_size // minibatch)
    optimizer = optax.chain(optax.clip_by_global_norm(0.5),
                            optax.adam(optax.linear_schedule(args.learning_rate, 0.0, n_updates)))
    state = {"actor": redeqx.init_state(actor, optimizer, mesh, specs["actor"], key=actor_state_key),
             "critic": redeqx.init_state(critic, optimizer, mesh, specs["critic"], key=critic_state_key)}
    ppo_step = redeqx.make_step(make_ppo_step(optimizer, optimizer, args.clip, args.ent_coef), mesh)
    act = redeqx.make_predict_step(act_fn, mesh, specs)
    greedy = redeqx.make_predict_step(greedy_fn, mesh, specs)
    log(f"{n_iters} rollouts of {rollout_size} steps, each {args.update_epochs} epochs of minibatches of {minibatch}")

    start, manager, logger = 0, None, None
    history = []  # [environment step, return] of every finished episode
    if args.workdir:
        manager = redeqx.CheckpointManager(args.workdir, keep_last=1, every=10, unit="epoch", best={"return": "max"})
        logger = redeqx.Logger(args.workdir)
        if args.resume and (found := manager.restore(state, mesh)) is not None:  # the live layout of both models
            state, meta = found
            start, history = meta["epoch"], meta["returns"]
            log(f"resumed from update {meta['step']}, rollout {start}")

    obs, _ = envs.reset(seed=args.seed + start)
    for it in range(start, n_iters):
        models = {name: ts.model for name, ts in state.items()}
        rollout, obs, returns = collect(envs, act, models, obs, args.n_steps, jax.random.fold_in(rollout_key, it),
                                        args.gamma, args.gae_lambda)
        env_steps = (it + 1) * rollout_size
        history += [[env_steps, float(r)] for r in returns]
        for epoch in range(args.update_epochs):
            for batch in redeqx.batches(rollout, collate_fn, args.per_device_batch_size, mesh, shuffle=True,
                                        key=jax.random.fold_in(data_key, it * args.update_epochs + epoch)):
                state, metrics = ppo_step(state, batch)
        recent = float(np.mean([r for _, r in history[-20:]])) if history else 0.0
        if it % 10 == 0 or it == n_iters - 1:
            log(f"rollout {it}: {env_steps} env steps, mean return (last 20 episodes) {recent:.1f}, "
                f"actor loss {float(metrics['actor_loss']):.4f}, critic loss {float(metrics['critic_loss']):.3f}")
        if manager is not None:
            logger.log({"episode_return": recent, **metrics}, env_steps)
            # at a SIGTERM: saves, exits 143 (preemption)
            manager.save(state, epoch=it + 1, metrics={"return": recent} if returns else None,
                         metadata={"returns": history}, force=it + 1 == n_iters)

    models = {name: ts.model for name, ts in state.items()}
    score = evaluate_greedy(greedy, models, args.n_envs, seed=args.seed + 1)
    log(f"final mean return (last 20 training episodes): {recent:.1f}")
    log(f"greedy policy: mean return {score:.1f} over {args.n_envs} episodes")
    if manager is not None:
        manager.close()
        logger.close()
        if jax.process_index() == 0 and history:
            plot_returns(history, os.path.join(args.workdir, "returns.png"), "PPO on CartPole-v1")
    return recent, score


def plot_returns(history, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, returns = map(np.asarray, zip(*history))
    smooth = np.convolve(returns, np.ones(20) / 20, mode="valid") if len(returns) >= 20 else returns
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
    ax.plot(steps, returns, ".", ms=2, alpha=0.3, label="episode")
    ax.plot(steps[len(steps) - len(smooth):], smooth, label="mean of 20")
    ax.set(xlabel="environment steps", ylabel="return", title=title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    redeqx.initialize()  # joins the other hosts' processes (SLURM, env vars, launcher); no-op on one host
    main()
