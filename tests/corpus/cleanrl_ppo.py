"""CleanRL ppo.py, shrunk: CartPole-v1 in a SyncVectorEnv, GAE, clipped surrogate, minibatches."""

import json
import random

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
from torch.distributions.categorical import Categorical

seed, num_envs, num_steps, total_timesteps = 1, 2, 16, 96
batch_size = num_envs * num_steps
minibatch_size = batch_size // 4
num_iterations = total_timesteps // batch_size
random.seed(seed)
np.random.seed(seed)
torch.manual_seed(seed)
torch.backends.cudnn.deterministic = True
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_env(env_id):
    def thunk():
        env = gym.make(env_id)
        env = gym.wrappers.RecordEpisodeStatistics(env)
        return env

    return thunk


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):  # noqa: B008 (CleanRL's own signature)
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self, envs):
        super().__init__()
        n = np.array(envs.single_observation_space.shape).prod()
        self.critic = nn.Sequential(
            layer_init(nn.Linear(n, 16)),
            nn.Tanh(),
            layer_init(nn.Linear(16, 16)),
            nn.Tanh(),
            layer_init(nn.Linear(16, 1), std=1.0),
        )
        self.actor = nn.Sequential(
            layer_init(nn.Linear(n, 16)),
            nn.Tanh(),
            layer_init(nn.Linear(16, 16)),
            nn.Tanh(),
            layer_init(nn.Linear(16, envs.single_action_space.n), std=0.01),
        )

    def get_value(self, x):
        return self.critic(x)

    def get_action_and_value(self, x, action=None):
        logits = self.actor(x)
        probs = Categorical(logits=logits)
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)


envs = gym.vector.SyncVectorEnv([make_env("CartPole-v1") for i in range(num_envs)])
agent = Agent(envs).to(device)
optimizer = optim.Adam(agent.parameters(), lr=2.5e-4, eps=1e-5)
torch.manual_seed(seed)  # sampling draws from the device's generator: seed it after the CPU-side init

obs = torch.zeros((num_steps, num_envs) + envs.single_observation_space.shape).to(device)
actions = torch.zeros((num_steps, num_envs) + envs.single_action_space.shape).to(device)
logprobs = torch.zeros((num_steps, num_envs)).to(device)
rewards = torch.zeros((num_steps, num_envs)).to(device)
dones = torch.zeros((num_steps, num_envs)).to(device)
values = torch.zeros((num_steps, num_envs)).to(device)

global_step = 0
next_obs, _ = envs.reset(seed=seed)
next_obs = torch.Tensor(next_obs).to(device)
next_done = torch.zeros(num_envs).to(device)
log = {"returns": [], "pg_loss": [], "v_loss": [], "approx_kl": [], "explained_var": []}
for iteration in range(1, num_iterations + 1):
    frac = 1.0 - (iteration - 1.0) / num_iterations
    optimizer.param_groups[0]["lr"] = frac * 2.5e-4
    for step in range(0, num_steps):
        global_step += num_envs
        obs[step] = next_obs
        dones[step] = next_done
        with torch.no_grad():
            action, logprob, _, value = agent.get_action_and_value(next_obs)
            values[step] = value.flatten()
        actions[step] = action
        logprobs[step] = logprob
        next_obs, reward, terminations, truncations, infos = envs.step(action.cpu().numpy())
        next_done = np.logical_or(terminations, truncations)
        rewards[step] = torch.tensor(reward).to(device).view(-1)
        next_obs, next_done = torch.Tensor(next_obs).to(device), torch.Tensor(next_done).to(device)
        if "episode" in infos:
            for r, m in zip(infos["episode"]["r"], infos["_episode"]):
                if m:
                    log["returns"].append(float(r))
    with torch.no_grad():
        next_value = agent.get_value(next_obs).reshape(1, -1)
        advantages = torch.zeros_like(rewards).to(device)
        lastgaelam = 0
        for t in reversed(range(num_steps)):
            if t == num_steps - 1:
                nextnonterminal = 1.0 - next_done
                nextvalues = next_value
            else:
                nextnonterminal = 1.0 - dones[t + 1]
                nextvalues = values[t + 1]
            delta = rewards[t] + 0.99 * nextvalues * nextnonterminal - values[t]
            advantages[t] = lastgaelam = delta + 0.99 * 0.95 * nextnonterminal * lastgaelam
        returns = advantages + values
    b_obs = obs.reshape((-1,) + envs.single_observation_space.shape)
    b_logprobs = logprobs.reshape(-1)
    b_actions = actions.reshape((-1,) + envs.single_action_space.shape)
    b_advantages = advantages.reshape(-1)
    b_returns = returns.reshape(-1)
    b_values = values.reshape(-1)
    b_inds = np.arange(batch_size)
    clipfracs = []
    for epoch in range(2):
        np.random.shuffle(b_inds)
        for start in range(0, batch_size, minibatch_size):
            mb_inds = b_inds[start : start + minibatch_size]
            _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb_inds], b_actions.long()[mb_inds])
            logratio = newlogprob - b_logprobs[mb_inds]
            ratio = logratio.exp()
            with torch.no_grad():
                old_approx_kl = (-logratio).mean()
                approx_kl = ((ratio - 1) - logratio).mean()
                clipfracs += [((ratio - 1.0).abs() > 0.2).float().mean().item()]
            mb_advantages = b_advantages[mb_inds]
            mb_advantages = (mb_advantages - mb_advantages.mean()) / (mb_advantages.std() + 1e-8)
            pg_loss1 = -mb_advantages * ratio
            pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - 0.2, 1 + 0.2)
            pg_loss = torch.max(pg_loss1, pg_loss2).mean()
            newvalue = newvalue.view(-1)
            v_loss_unclipped = (newvalue - b_returns[mb_inds]) ** 2
            v_clipped = b_values[mb_inds] + torch.clamp(newvalue - b_values[mb_inds], -0.2, 0.2)
            v_loss_clipped = (v_clipped - b_returns[mb_inds]) ** 2
            v_loss = 0.5 * torch.max(v_loss_unclipped, v_loss_clipped).mean()
            entropy_loss = entropy.mean()
            loss = pg_loss - 0.01 * entropy_loss + v_loss * 0.5
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(agent.parameters(), 0.5)
            optimizer.step()
    y_pred, y_true = b_values.cpu().numpy(), b_returns.cpu().numpy()
    var_y = np.var(y_true)
    log["explained_var"].append(float(np.nan if var_y == 0 else 1 - np.var(y_true - y_pred) / var_y))
    log["pg_loss"].append(pg_loss.item())
    log["v_loss"].append(v_loss.item())
    log["approx_kl"].append(approx_kl.item())
    log["clipfrac"] = float(np.mean(clipfracs))
envs.close()
print(
    json.dumps(
        {
            "device": str(next(agent.parameters()).device),
            **log,
            "actor_sum": sum(p.sum().item() for p in agent.actor.parameters()),
        }
    )
)
