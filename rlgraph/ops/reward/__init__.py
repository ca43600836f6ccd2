"""Rewards: the ops that score responses and the functions they score with.

`rule` holds the rule-reward op body (`RewardWorker`) and the small reward ops
(`combine_rewards`, `overlong_penalty`, `filter_groups`); `functions` the scoring functions
with verl's ``compute_score`` signature, the built-in one included, and loading a user's
``reward.fn``; `scorer` runs a call's samples concurrently under time limits (`RewardScorer`);
`model` the reward-model op (`RewardModelWorker`) and the tiny trained reward model of the
examples.
"""
