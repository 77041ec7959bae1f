# SAPO ("Soft Adaptive Policy Optimization", Qwen 2025, arXiv 2511.20347): the hard clip is
# replaced by a smooth gate (4/tau) sigmoid(tau (rho - 1)) whose gradient weight decays as rho
# leaves 1; negative advantages get the faster-decaying temperature (1.05 vs 1.0). Each
# sequence's token mean then the mean over sequences, as verl forces; no KL.
# verl loss_mode=sapo (tau_pos, tau_neg); TRL loss_type="sapo" (sapo_temperature_pos/neg).
algorithm sapo extends grpo
  "A soft, temperature-controlled gate on the ratio instead of PPO's hard clip."
  trust_region  soft_gate(tau_pos=1.0, tau_neg=1.05)
  kl            none
