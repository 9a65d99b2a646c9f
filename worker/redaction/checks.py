"""Checksums that tell a payment card or an IBAN from an ordinary number."""

from __future__ import annotations

from typing import Final

# ISO 13616 IBAN lengths by country (SWIFT IBAN registry).
IBAN_LENGTHS: Final = {
    **dict.fromkeys(("NO",), 15),
    **dict.fromkeys(("BE",), 16),
    **dict.fromkeys(("DK", "FI", "FK", "FO", "GL", "NL", "SD"), 18),
    **dict.fromkeys(("MK", "SI"), 19),
    **dict.fromkeys(("AT", "BA", "EE", "KZ", "LT", "LU", "MN", "XK"), 20),
    **dict.fromkeys(("CH", "HR", "LI", "LV"), 21),
    **dict.fromkeys(("BG", "BH", "CR", "DE", "GB", "GE", "IE", "ME", "RS", "VA"), 22),
    **dict.fromkeys(("AE", "GI", "IL", "IQ", "OM", "SO", "TL"), 23),
    **dict.fromkeys(("AD", "CZ", "ES", "MD", "PK", "RO", "SA", "SE", "SK", "TN", "VG"), 24),
    **dict.fromkeys(("LY", "PT", "ST"), 25),
    **dict.fromkeys(("IS", "TR"), 26),
    **dict.fromkeys(("BI", "DJ", "FR", "GR", "IT", "MC", "MR", "SM"), 27),
    **dict.fromkeys(("AL", "AZ", "BY", "CY", "DO", "GT", "HU", "LB", "NI", "PL", "SV"), 28),
    **dict.fromkeys(("BR", "EG", "PS", "QA", "UA"), 29),
    **dict.fromkeys(("JO", "KW", "MU", "YE"), 30),
    **dict.fromkeys(("MT", "SC"), 31),
    **dict.fromkeys(("LC",), 32),
    **dict.fromkeys(("RU",), 33),
}


def luhn_valid(digits: str) -> bool:
    """The Luhn (mod 10) check of a string of ASCII digits."""
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def card_brand_length_ok(digits: str) -> bool:
    """The number has a card brand's prefix (IIN range) and one of that brand's lengths."""
    n, p2, p3, p4 = len(digits), int(digits[:2]), int(digits[:3]), int(digits[:4])
    if digits[0] == "4":  # Visa
        return n in (13, 16, 19)
    if 51 <= p2 <= 55 or 2221 <= p4 <= 2720:  # Mastercard
        return n == 16
    if p2 in (34, 37):  # American Express
        return n == 15
    if 2200 <= p4 <= 2204 or 3528 <= p4 <= 3589:  # Mir, JCB
        return 16 <= n <= 19
    if p2 in (36, 38, 39) or 300 <= p3 <= 305:  # Diners Club
        return 14 <= n <= 19
    return (p2 == 50 or 56 <= p2 <= 69) and 13 <= n <= 19  # Maestro, Discover, UnionPay, RuPay


def card_valid(digits: str) -> bool:
    """13–19 ASCII digits with a brand's prefix and length and a valid Luhn check digit."""
    return (
        13 <= len(digits) <= 19
        and digits.isascii()
        and digits.isdigit()
        and card_brand_length_ok(digits)
        and luhn_valid(digits)
    )


def iban_valid(compact: str) -> bool:
    """``compact``: upper case, no spaces. The country's length, then ISO 13616 mod-97 == 1."""
    if not (compact.isascii() and compact.isalnum()) or not compact[2:4].isdigit():
        return False
    if IBAN_LENGTHS.get(compact[:2]) != len(compact):
        return False
    rearranged = compact[4:] + compact[:4]
    return int("".join(str(int(ch, 36)) for ch in rearranged)) % 97 == 1
