"""Model-card templates (shipped inside the package as hf_spec_cotrain.model_cards)."""
