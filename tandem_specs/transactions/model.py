"""The reference model: payment risk from the transaction and its account's last K transactions."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tandem_specs.transactions.features import CURRENT_NUMERIC, HISTORY_NUMERIC_WIDTH
from tandem_specs.transactions.records import COUNTRIES, CURRENCIES, MERCHANT_CATEGORIES

# Embedding rows: each vocabulary plus its unknown bucket (history items also have the empty slot
# 0), and the hour and weekday: (the current record's, the history items').
EMBEDDING_SIZES = (
    (len(CURRENCIES) + 1, len(MERCHANT_CATEGORIES) + 1, len(COUNTRIES) + 1, 24, 7),
    (len(MERCHANT_CATEGORIES) + 2, len(COUNTRIES) + 2),
)
CURRENT_NUMERIC_WIDTH = len(CURRENT_NUMERIC)
# Share of the training rows' categorical values (currency, category, country; the record's and
# its history's) replaced by their field's unknown index. Without it no training row ever holds
# the unknown index (every stored value is in the vocabulary), so the unknown embedding rows keep
# their random initialisation and an unseen value would get an arbitrary score. Masking a small
# share (as word dropout trains an NLP model's UNK token) teaches each row "a value of this field
# the model cannot tell apart", and costs the known values next to nothing.
UNKNOWN_MASK_SHARE = 0.02


@dataclass(frozen=True)
class ModelConfig:
    history_length: int = 16
    embedding_dim: int = 16
    history_dim: int = 256
    hidden_dim: int = 1024
    head_tail_dim: int = 256


class RiskModel(nn.Module):
    """Embeddings for the categoricals, an encoder over the account's history, an MLP head.

    It is deliberately wide (about 2M parameters, about 6 MFLOP per item) so that, on a CPU,
    scoring one item at a time is bound by reading weights and batching pays several times over;
    that is the property both serving paths are designed around.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        e = config.embedding_dim
        current_sizes, history_sizes = EMBEDDING_SIZES
        self.current_embeddings = nn.ModuleList(nn.Embedding(size, e) for size in current_sizes)
        self.current_numeric = nn.Sequential(nn.Linear(CURRENT_NUMERIC_WIDTH, 4 * e), nn.ReLU())
        self.history_embeddings = nn.ModuleList(nn.Embedding(size, e, padding_idx=0) for size in history_sizes)
        item_width = e * len(history_sizes) + HISTORY_NUMERIC_WIDTH
        self.history_encoder = nn.Sequential(
            nn.Linear(item_width, config.history_dim),
            nn.ReLU(),
            nn.Linear(config.history_dim, config.history_dim),
            nn.ReLU(),
        )
        head_width = e * len(current_sizes) + 4 * e + 2 * config.history_dim
        self.head = nn.Sequential(
            nn.Linear(head_width, config.hidden_dim),
            nn.ReLU(),
            nn.Linear(config.hidden_dim, config.hidden_dim),
            nn.ReLU(),
            nn.Linear(config.hidden_dim, config.head_tail_dim),
            nn.ReLU(),
            nn.Linear(config.head_tail_dim, 1),
        )

    def forward(
        self,
        current_categorical: torch.Tensor,
        current_numeric: torch.Tensor,
        history_categorical: torch.Tensor,
        history_numeric: torch.Tensor,
        history_mask: torch.Tensor,
    ) -> torch.Tensor:
        """Logits, one per item."""
        current = torch.cat(
            [emb(current_categorical[:, i]) for i, emb in enumerate(self.current_embeddings)]
            + [self.current_numeric(current_numeric)],
            dim=1,
        )
        items = torch.cat(
            [emb(history_categorical[:, :, i]) for i, emb in enumerate(self.history_embeddings)] + [history_numeric],
            dim=2,
        )
        encoded = self.history_encoder(items)
        mask = history_mask.unsqueeze(-1)
        count = mask.sum(dim=1).clamp(min=1)
        mean = (encoded * mask).sum(dim=1) / count
        # Encoded items are post-ReLU (>= 0), so zeroing padded slots leaves the max unchanged.
        peak = (encoded * mask).amax(dim=1)
        return self.head(torch.cat([current, mean, peak], dim=1)).squeeze(1)

    def flops_per_item(self) -> int:
        """Multiply-adds x 2 of the dense layers; embeddings and pooling are negligible."""
        k = self.config.history_length
        history = sum(2 * m.in_features * m.out_features for m in self.history_encoder if isinstance(m, nn.Linear))
        dense = sum(2 * m.in_features * m.out_features for m in self.head if isinstance(m, nn.Linear))
        numeric = sum(2 * m.in_features * m.out_features for m in self.current_numeric if isinstance(m, nn.Linear))
        return k * history + dense + numeric


def mask_to_unknown(
    arrays: tuple[np.ndarray, ...], seed: int, *, share: float = UNKNOWN_MASK_SHARE
) -> tuple[np.ndarray, ...]:
    """The training arrays with a seeded `share` of categorical values set to the unknown bucket.

    History padding (mask False) stays padding; history indices are shifted by one (0 = padding).
    """
    current_categorical, current_numeric, history_categorical, history_numeric, history_mask = arrays
    current_sizes, history_sizes = EMBEDDING_SIZES
    rng = np.random.default_rng([seed, 0x0B5E])
    current = current_categorical.copy()
    # The vocabulary columns in the order `unseen_fields` names them (country, currency,
    # merchant_category), so the seeded draws fall as they always have.
    for column in (2, 0, 1):
        current[rng.random(len(current)) < share, column] = current_sizes[column] - 1
    history_unknown = np.array([size - 1 for size in history_sizes], dtype=np.int64)
    hit = (rng.random(history_categorical.shape) < share) & history_mask[:, :, None]
    history = np.where(hit, history_unknown, history_categorical)
    return current, current_numeric, history, history_numeric, history_mask
