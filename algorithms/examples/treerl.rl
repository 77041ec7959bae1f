# TreeRL (Hou et al. 2025, "TreeRL: LLM Reinforcement Learning with On-Policy Tree Search", arXiv
# 2506.11902; code github.com/THUDM/TreeRL, openrlhf/trainer/ppo_utils/tree_node.py and
# parallel_mcts.py gather_paths): rows are the leaves of a tree per prompt (`sampling tree`:
# answers forked at their highest -log pi tokens), each holding its whole path. A token's
# advantage is its tree node's: (V(node) - V(parent)) + (V(node) - V(root)), where V is the mean
# leave-one-out reward of the leaves below a node, G/(G-1) (mean - root mean), divided by the
# square root of how many leaves those are (the authors' use_weighted_value, sqrt; the root's V
# is 0). The loss is the authors' OpenRLHF PolicyLoss: PPO clip 0.2 below and 0.26 above on the
# unclamped ratio, each sequence's token mean, then the mean; no KL (scripts/treerl-qw14b.sh).
algorithm treerl extends grpo
  "Tree-search RL: per-node advantages of a tree of forked answers (sampling tree)."
  define tree_node_value
    c = G / (G - 1)
    v = c * (node_value - root_value) / sqrt(node_leaves)
    v_parent = c * (parent_value - root_value) / sqrt(parent_leaves)
    A = (v - v_parent) + v
  end
  sampling      tree(M=2, N=1, L=1, T=1)
  baseline      tree_node_value
  normalizer    none
  ratio         token(clamp=1000)
  trust_region  clip(low=0.2, high=0.26)
  kl            none
  aggregation   seq_mean_token_mean
