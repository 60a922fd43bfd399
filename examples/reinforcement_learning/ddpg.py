"""Deep Deterministic Policy Gradient (DDPG) on gymnasium's Pendulum-v1: an
actor, a critic, their target networks and a replay buffer in one state,
updated by compiled redeqx steps.

    python examples/reinforcement_learning/ddpg.py                      # 8 simulated CPU devices
    python examples/reinforcement_learning/ddpg.py --n_model_shards 1 --per_device_batch_size 32
    python examples/reinforcement_learning/ddpg.py --workdir runs/ddpg  # + checkpoints, TensorBoard, returns.png
    python examples/reinforcement_learning/ddpg.py --workdir runs/ddpg --resume
    tensorboard --logdir runs/ddpg

The loop is yours: step the environments on the host with the actor's compiled
forward pass plus exploration noise; after each episode, add its transitions
to the replay buffer (on the devices) and run one update per transition, each
on a batch sampled from the buffer and split over the data axis.
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
from jax.sharding import PartitionSpec as P  # noqa: E402

import redeqx  # noqa: E402


class Actor(eqx.Module):
    mlp: eqx.nn.MLP
    max_action: float = eqx.field(static=True)

    def __init__(self, n_obs, n_act, hidden, max_action, *, key):
        self.mlp = eqx.nn.MLP(n_obs, n_act, hidden, depth=2, activation=jax.nn.relu, key=key)
        self.max_action = max_action

    def __call__(self, obs):
        return self.max_action * jnp.tanh(self.mlp(obs))


class Critic(eqx.Module):
    mlp: eqx.nn.MLP

    def __init__(self, n_obs, n_act, hidden, *, key):
        self.mlp = eqx.nn.MLP(n_obs + n_act, "scalar", hidden, depth=2, activation=jax.nn.relu, key=key)

    def __call__(self, obs, action):
        return self.mlp(jnp.concatenate([obs, action]))


def act_fn(actor, batch, key, noise):
    """The actor's action for each environment, plus Gaussian exploration noise."""
    action = jax.vmap(actor)(batch["obs"])  # (n_envs, n_act)
    action = action + noise * actor.max_action * jax.random.normal(key, action.shape)
    return jnp.clip(action, -actor.max_action, actor.max_action)


def soft_update(target, online, tau):
    """target <- (1 - tau) target + tau online, for every parameter."""
    params = optax.incremental_update(eqx.filter(online, eqx.is_array), eqx.filter(target, eqx.is_array), tau)
    return eqx.combine(params, target)


def add_step(state, chunk):
    """Write a chunk of transitions into the circular replay buffer."""
    buf = state["buffer"]
    n, capacity = chunk["reward"].shape[0], buf["reward"].shape[0]
    idx = (buf["ptr"] + jnp.arange(n)) % capacity
    new = {k: buf[k].at[idx].set(v) for k, v in chunk.items()}
    new.update(ptr=(buf["ptr"] + n) % capacity, size=jnp.minimum(buf["size"] + n, capacity))
    return {**state, "buffer": new}, None


def make_train_step(optimizer, batch_size, gamma, tau, n_updates):
    def update(nets, buf):
        actor, critic = nets["actor"], nets["critic"]
        key, sample_key = jax.random.split(critic.key)
        idx = jax.random.randint(sample_key, (batch_size,), 0, buf["size"])
        b = redeqx.constrain({k: buf[k][idx] for k in ("obs", "action", "reward", "next_obs", "done")}, P("data"))
        next_q = jax.vmap(nets["target_critic"])(b["next_obs"], jax.vmap(nets["target_actor"])(b["next_obs"]))
        target = b["reward"] + gamma * (1.0 - b["done"]) * next_q  # (B,)

        def critic_loss(model):
            q = jax.vmap(model)(b["obs"], b["action"])
            return jnp.mean((q - target) ** 2), q.mean()

        (c_loss, q), c_grads = eqx.filter_value_and_grad(critic_loss, has_aux=True)(critic.model)
        critic = eqx.tree_at(lambda s: s.key, redeqx.apply_gradients(critic, c_grads, optimizer), key)

        def actor_loss(model):  # ascend the (just updated) critic's value of the actor's actions
            return -jnp.mean(jax.vmap(critic.model)(b["obs"], jax.vmap(model)(b["obs"])))

        a_loss, a_grads = eqx.filter_value_and_grad(actor_loss)(actor.model)
        actor = redeqx.apply_gradients(actor, a_grads, optimizer)
        nets = {"actor": actor, "critic": critic,
                "target_actor": soft_update(nets["target_actor"], actor.model, tau),
                "target_critic": soft_update(nets["target_critic"], critic.model, tau)}
        return nets, {"critic_loss": c_loss, "actor_loss": a_loss, "q": q}

    def train_step(state):
        """n_updates updates in a row, each on its own batch sampled from the buffer."""
        # lax.scan carries arrays only: the networks' activation functions stay outside
        nets, static = eqx.partition({k: v for k, v in state.items() if k != "buffer"}, eqx.is_array)

        def body(nets, _):
            nets, metrics = update(eqx.combine(nets, static), state["buffer"])
            return eqx.filter(nets, eqx.is_array), metrics

        nets, metrics = jax.lax.scan(body, nets, length=n_updates)
        return {**eqx.combine(nets, static), "buffer": state["buffer"]}, jax.tree.map(jnp.mean, metrics)

    return train_step


def evaluate_policy(greedy, actor, n_envs, seed):
    """One episode per environment with the noiseless actor; the mean return."""
    envs = gym.vector.SyncVectorEnv([lambda: gym.make("Pendulum-v1")] * n_envs)
    obs, _ = envs.reset(seed=seed)
    total, alive = np.zeros(n_envs), np.ones(n_envs, bool)
    while alive.any():
        obs, reward, term, trunc, _ = envs.step(np.asarray(greedy(actor, {"obs": obs}, jax.random.key(0))))
        total += reward * alive
        alive &= ~(term | trunc)
    return total.mean()


def log(*args):
    if jax.process_index() == 0:  # every process runs this script; one of them speaks
        print(*args, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n_model_shards", type=int, default=2)
    parser.add_argument("--per_device_batch_size", type=int, default=64, help="update batch = this x data devices")
    parser.add_argument("--total_steps", type=int, default=16_000, help="environment steps, all envs together")
    parser.add_argument("--buffer_size", type=int, default=50_000, help="replay buffer capacity, in transitions")
    parser.add_argument("--learning_starts", type=int, default=2_000, help="random actions before this step")
    parser.add_argument("--n_envs", type=int, default=8, help="a multiple of the data devices")
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--gamma", type=float, default=0.98)
    parser.add_argument("--tau", type=float, default=0.005, help="target networks' soft update rate")
    parser.add_argument("--noise", type=float, default=0.1, help="exploration noise, times the action bound")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", help="checkpoints, logs and returns.png go here")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --workdir")
    args = parser.parse_args()
    if args.resume and not args.workdir:
        parser.error("--resume needs --workdir")

    key = jax.random.key(args.seed)
    actor_key, critic_key, actor_state_key, critic_state_key, explore_key = jax.random.split(key, 5)
    # Every process (redeqx.launch, several hosts) steps these same environments from the same seed, so the
    # observations each passes to the compiled steps are the same global batch.
    envs = gym.wrappers.vector.RecordEpisodeStatistics(gym.vector.SyncVectorEnv(
        [lambda: gym.make("Pendulum-v1")] * args.n_envs, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP))
    envs.action_space.seed(args.seed)
    n_obs, n_act = envs.single_observation_space.shape[0], envs.single_action_space.shape[0]
    episode_len = gym.spec("Pendulum-v1").max_episode_steps  # Pendulum never terminates early: 200 steps

    mesh = redeqx.make_mesh(args.n_model_shards)
    actor = Actor(n_obs, n_act, args.hidden, float(envs.single_action_space.high[0]), key=actor_key)
    critic = Critic(n_obs, n_act, args.hidden, key=critic_key)
    # name rules only: the actor's loss runs through the critic, the critic's through the targets (no one-model loss_fn)
    a_specs = redeqx.sharding_rules(actor, mesh, name="actor")
    c_specs = redeqx.sharding_rules(critic, mesh, name="critic")
    log(f"{len(jax.devices())} devices, mesh {dict(mesh.shape)}")
    log(redeqx.explain(critic, c_specs, mesh))

    optimizer = optax.adam(args.learning_rate)
    n = args.buffer_size
    buffer = {"obs": np.zeros((n, n_obs), np.float32), "action": np.zeros((n, n_act), np.float32),
              "reward": np.zeros(n, np.float32), "next_obs": np.zeros((n, n_obs), np.float32),
              "done": np.zeros(n, np.float32), "ptr": np.int32(0), "size": np.int32(0)}
    state = {"actor": redeqx.init_state(actor, optimizer, mesh, a_specs, key=actor_state_key),
             "critic": redeqx.init_state(critic, optimizer, mesh, c_specs, key=critic_state_key),
             "target_actor": redeqx.shard(actor, a_specs, mesh),  # copies: the targets start equal, then lag
             "target_critic": redeqx.shard(critic, c_specs, mesh),
             "buffer": redeqx.shard(buffer, jax.tree.map(lambda _: P(), buffer), mesh)}  # replicated
    batch_size = args.per_device_batch_size * mesh.shape["data"]
    add = redeqx.make_step(add_step, mesh)
    per_round = episode_len * args.n_envs  # transitions added, and updates run, per round
    train = redeqx.make_step(make_train_step(optimizer, batch_size, args.gamma, args.tau, per_round), mesh)
    explore = redeqx.make_predict_step(functools.partial(act_fn, noise=args.noise), mesh, a_specs)
    greedy = redeqx.make_predict_step(functools.partial(act_fn, noise=0.0), mesh, a_specs)

    start, manager, logger = 0, None, None
    history = []  # [environment step, return] of every finished episode
    if args.workdir:
        manager = redeqx.CheckpointManager(args.workdir, keep_last=1, unit="epoch", best={"return": "max"})
        logger = redeqx.Logger(args.workdir)
        if args.resume and (found := manager.restore(state, mesh)) is not None:  # networks, targets and buffer
            state, meta = found
            start, history = meta["epoch"], meta["returns"]
            log(f"resumed from update {meta['step']}, episode round {start}")

    obs, _ = envs.reset(seed=args.seed + start)
    n_rounds = args.total_steps // per_round  # a round = one episode in every environment
    for rnd in range(start, n_rounds):
        chunk = []
        for t in range(episode_len):
            env_step = (rnd * episode_len + t) * args.n_envs
            if env_step < args.learning_starts:
                action = envs.action_space.sample()
            else:
                step_key = jax.random.fold_in(explore_key, env_step)
                action = np.asarray(explore(state["actor"].model, {"obs": obs}, step_key))
            next_obs, reward, term, trunc, info = envs.step(action)
            real_next = next_obs.copy()  # where an episode ended, next_obs is already the next one's start
            if "final_obs" in info:
                real_next[info["_final_obs"]] = np.stack(info["final_obs"][info["_final_obs"]])
                history += [[env_step + args.n_envs, float(r)] for r in info["episode"]["r"][info["_episode"]]]
            chunk.append({"obs": obs, "action": action, "reward": reward, "next_obs": real_next, "done": term})
            obs = next_obs
        transitions = {k: np.concatenate([c[k] for c in chunk]).astype(np.float32) for k in chunk[0]}
        state, _ = add(state, transitions)
        env_steps = (rnd + 1) * per_round
        if env_steps >= args.learning_starts:  # one update per new transition
            state, metrics = train(state)
            recent = float(np.mean([r for _, r in history[-10:]]))
            log(f"round {rnd}: {env_steps} env steps, mean return (last 10 episodes) {recent:.1f}, "
                f"critic loss {float(metrics['critic_loss']):.3f}, Q {float(metrics['q']):.1f}")
            if manager is not None:
                logger.log({"episode_return": recent, **metrics}, env_steps)
                # at a SIGTERM: saves, exits 143 (preemption)
                manager.save(state, epoch=rnd + 1, metrics={"return": recent}, metadata={"returns": history})

    recent = float(np.mean([r for _, r in history[-10:]])) if history else float("nan")
    score = evaluate_policy(greedy, state["actor"].model, args.n_envs, seed=args.seed + 1)
    log(f"final mean return (last 10 training episodes): {recent:.1f}")
    log(f"noiseless policy: mean return {score:.1f} over {args.n_envs} episodes")
    if manager is not None:
        manager.close()
        logger.close()
        if jax.process_index() == 0 and history:
            plot_returns(history, os.path.join(args.workdir, "returns.png"), "DDPG on Pendulum-v1")
    return recent, score


def plot_returns(history, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, returns = map(np.asarray, zip(*history))
    smooth = np.convolve(returns, np.ones(10) / 10, mode="valid") if len(returns) >= 10 else returns
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
    ax.plot(steps, returns, ".", ms=3, alpha=0.4, label="episode")
    ax.plot(steps[len(steps) - len(smooth):], smooth, label="mean of 10")
    ax.set(xlabel="environment steps", ylabel="return", title=title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    redeqx.initialize()  # joins the other hosts' processes (SLURM, env vars, launcher); no-op on one host
    main()
