"""The reference's records: its vocabularies, what a well-formed value looks like, its bounds and
the order its reasons are checked in."""

from __future__ import annotations

# The training vocabularies: the values the model has an embedding row of its own for. A value
# outside them that is well-formed (see the patterns below) is scored through the feature
# pipeline's "unknown" bucket and flagged (`unseen_fields`), never refused: a merchant category
# that appears tomorrow is a drift to watch, not poison.
CURRENCIES: tuple[str, ...] = ("USD", "EUR", "GBP", "JPY", "CHF", "CAD", "AUD", "SEK")
MERCHANT_CATEGORIES: tuple[str, ...] = (
    "grocery",
    "restaurant",
    "fuel",
    "pharmacy",
    "clothing",
    "travel",
    "hotel",
    "airline",
    "entertainment",
    "utilities",
    "telecom",
    "insurance",
    "education",
    "health",
    "home_improvement",
    "sporting_goods",
    "electronics",
    "jewelry",
    "gift_cards",
    "crypto_exchange",
    "money_transfer",
    "gambling",
    "subscription",
    "marketplace",
)
COUNTRIES: tuple[str, ...] = (
    "US",
    "CA",
    "MX",
    "GB",
    "IE",
    "FR",
    "DE",
    "NL",
    "BE",
    "ES",
    "IT",
    "PT",
    "CH",
    "AT",
    "SE",
    "NO",
    "DK",
    "FI",
    "PL",
    "JP",
    "AU",
    "NZ",
    "SG",
    "BR",
    "NG",
    "RU",
)
# What a well-formed value looks like, checked alike by `validate()` (polars) and the record
# model (pydantic); both use Rust's regex engine, where `$` is the end of the text (Python's `re` would
# also accept a trailing newline). ISO 4217 / ISO 3166-1 alpha-2 shapes, not their code lists:
# a code issued tomorrow is well-formed.
CURRENCY_PATTERN = r"^[A-Z]{3}$"
COUNTRY_PATTERN = r"^[A-Z]{2}$"
CATEGORY_MAX_LENGTH = 64
# After stripping surrounding whitespace: 1-64 ASCII letters, digits, spaces and `_ - & / .`, room
# for names such as "ev_charging", "Home & Garden" or "b2b/saas", none for markup, quotes,
# control characters or the debris of a mis-split CSV line. ASCII only, so a look-alike Unicode
# letter cannot open a second spelling of one category.
CATEGORY_PATTERN = rf"^[A-Za-z0-9 _&/.-]{{1,{CATEGORY_MAX_LENGTH}}}$"
# An amount above this is a unit or parsing error upstream, not a purchase.
MAX_PLAUSIBLE_AMOUNT = 1_000_000.0
# The order rules are checked in, so a row breaking several rules always gets the same reason.
REASON_ORDER: tuple[str, ...] = (
    "nul_character",
    "missing_field",
    "duplicate_id",
    "bad_currency",
    "amount_unparsable",
    "amount_not_finite",
    "amount_negative",
    "amount_absurd",
    "malformed_category",
    "malformed_country",
    "timestamp_missing",
    "timestamp_unparsable",
)
