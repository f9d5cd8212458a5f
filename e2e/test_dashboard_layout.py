"""The dashboard's pages as people see and use them: a desktop and a phone screen, the keyboard,
assistive technology. Every page is checked in Chromium for what only a browser shows: nothing
scrolls the page sideways on a phone (tables scroll inside their own region), every control has a
label and every button or link a name, one h1 and the landmarks, readable text contrast, and
axe-core's WCAG 2.1 AA rules; a screenshot of each page at each size is saved under e2e/artifacts/.
"""

from __future__ import annotations

import re
from typing import Any

from eth_account import Account
from playwright.sync_api import Page, expect

from e2e.a11y import violations
from e2e.conftest import Shot, Stack
from e2e.test_dashboard import (
    _networks,
    add_endpoint,
    confirm_paste,
    delivery_card,
    fail_until_released,
    go,
    reload_until,
    send_test_event,
    sign_up,
)
from tests.webhooks.receiver import Receiver

SIZES = {"desktop": {"width": 1280, "height": 800}, "phone": {"width": 390, "height": 844}}

# Problems a page shows in the browser, as a list of messages (empty when it is fine).
AUDIT = """
() => {
  const problems = [];
  const root = document.documentElement;
  if (root.scrollWidth > window.innerWidth) {
    const wide = [...document.body.querySelectorAll('*')].filter(
      (el) => el.getBoundingClientRect().right > window.innerWidth + 1);
    problems.push(`the page scrolls sideways (${root.scrollWidth} > ${window.innerWidth}): ` +
      wide.slice(-3).map((el) => el.outerHTML.slice(0, 120)).join(' | '));
  }
  const visible = (el) => el.getClientRects().length > 0;
  for (const el of document.querySelectorAll('input:not([type=hidden]), select, textarea')) {
    if (!el.labels.length && !el.getAttribute('aria-label') && !el.getAttribute('aria-labelledby')) {
      problems.push(`unlabelled control: ${el.outerHTML.slice(0, 120)}`);
    }
  }
  for (const el of document.querySelectorAll('a, button, [role=button]')) {
    if (el.tagName === 'A' && !el.hasAttribute('href')) problems.push(`a link without href: ${el.outerHTML}`);
    if (el.tagName !== 'BUTTON' && el.getAttribute('role') === 'button') problems.push(`fake button: ${el.outerHTML}`);
    if (!el.textContent.trim() && !el.getAttribute('aria-label')) problems.push(`nameless: ${el.outerHTML}`);
  }
  const ids = [...document.querySelectorAll('[id]')].map((el) => el.id);
  const dupes = ids.filter((id, i) => ids.indexOf(id) !== i);
  if (dupes.length) problems.push(`duplicate ids: ${dupes.join(', ')}`);
  const h1 = document.querySelectorAll('h1').length;
  if (h1 !== 1) problems.push(`${h1} h1 headings`);
  for (const tag of ['header', 'main', 'footer']) {
    if (document.querySelectorAll(tag).length !== 1) problems.push(`not exactly one <${tag}>`);
  }

  // WCAG AA text contrast: 4.5:1, or 3:1 for large text (24px, or 18.66px bold).
  const rgb = (text) => (text.match(/[\\d.]+/g) || []).map(Number);
  const luminance = ([r, g, b]) => {
    const lin = (c) => { c /= 255; return c <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4; };
    return 0.2126 * lin(r) + 0.7152 * lin(g) + 0.0722 * lin(b);
  };
  const background = (el) => {
    for (let node = el; node; node = node.parentElement) {
      const bg = rgb(getComputedStyle(node).backgroundColor);
      if (bg.length === 3 || (bg.length === 4 && bg[3] > 0)) return bg.slice(0, 3);
    }
    return [255, 255, 255];
  };
  for (const el of document.body.querySelectorAll('*')) {
    const ownText = [...el.childNodes].some((n) => n.nodeType === 3 && n.textContent.trim());
    if (!ownText || !visible(el) || el.closest('.visually-hidden, .skip-link')) continue;
    const style = getComputedStyle(el);
    const fg = luminance(rgb(style.color)), bg = luminance(background(el));
    const ratio = (Math.max(fg, bg) + 0.05) / (Math.min(fg, bg) + 0.05);
    const size = parseFloat(style.fontSize), bold = parseInt(style.fontWeight, 10) >= 700;
    const needed = size >= 24 || (bold && size >= 18.66) ? 3 : 4.5;
    if (ratio < needed) {
      problems.push(`contrast ${ratio.toFixed(2)} < ${needed}: "${el.textContent.trim().slice(0, 40)}"`);
    }
  }
  return problems;
}
"""


def audit(page: Page) -> list[str]:
    return page.evaluate(AUDIT)  # type: ignore[no-any-return]


def look_at(page: Page, shot: Shot, pages: dict[str, str], *, logged_in: bool) -> None:
    """Open each page at each size: audit it and save a screenshot ``<size>-<name>``."""
    problems: dict[str, list[str]] = {}
    for size, viewport in SIZES.items():
        page.set_viewport_size(viewport)
        for name, url in pages.items():
            page.goto(url)
            expect(page.get_by_role("main")).to_be_visible()
            expect(page.get_by_role("banner")).to_be_visible()
            expect(page.get_by_role("contentinfo")).to_be_visible()
            if logged_in:
                expect(page.get_by_role("navigation", name="Dashboard")).to_be_visible()
            found = audit(page) + [f"axe {v}" for v in violations(page)]
            if found:
                problems[f"{size} {name}"] = found
            shot(page, f"{size}-{name}")
    assert not problems, problems


def test_every_page_on_a_desktop_and_a_phone(page: Page, stack: Stack, receiver: Receiver, shot: Shot) -> None:
    merchant = sign_up(page, name="The Very Long Named Mug & Cup Emporium of Greater Springfield")
    go(page, "Wallets")
    evm = _networks(stack)[0]
    page.get_by_label(f"Wallet address on {evm['name']}").fill(Account.create().address)
    confirm_paste(page, evm["name"])
    page.get_by_role("button", name="Save wallet").first.click()
    fail_until_released(receiver)  # a failed attempt in the log, with its response body
    add_endpoint(page, receiver.url("/hooks/a/rather/long/path/for/a/receiver?token=0123456789abcdef0123456789"))
    _, delivery_id = send_test_event(page, "payment.completed")
    reload_until(page, delivery_card(page, delivery_id).locator(".badge-failed"))
    webhook = page.url.removeprefix(stack.base_url)
    intents = [
        stack.create_intent(12.5, key=merchant.first_key, order_id=f"order-{n}-{'x' * 40}", description="Two mugs")
        for n in range(3)
    ]
    stack.api("DELETE", f"/x402/intents/{intents[0]['intent_id']}", key=merchant.first_key)
    link = {"amount_usdc": 9.99, "description": "A poster of the Emporium, printed on heavy matte paper, A2"}
    assert stack.api("POST", "/payment_links", key=merchant.first_key, json=link).status_code == 201
    page.goto("/dashboard/keys")
    revoke = page.get_by_role("link", name=re.compile("^Revoke")).first.get_attribute("href")
    assert revoke

    look_at(
        page,
        shot,
        {
            "overview": "/dashboard/",
            "keys": "/dashboard/keys",
            "revoke": revoke,
            "wallets": "/dashboard/wallets",
            "webhooks": "/dashboard/webhooks",
            "webhook": webhook,
            "rotate": f"{webhook}/rotate",
            "delivery": f"{webhook}/deliveries/{delivery_id}",
            "intents": "/dashboard/intents",
            "intents-filtered": "/dashboard/intents?status=nonsense",
            "intent": f"/dashboard/intents/{intents[1]['intent_id']}",
            "not-found": "/dashboard/intents/nope",
            "links": "/dashboard/links",
        },
        logged_in=True,
    )

    page.set_viewport_size(SIZES["phone"])  # the important columns come first on a phone
    page.goto("/dashboard/intents")
    table = page.get_by_role("region", name="Intents")
    first_row = table.get_by_role("row").nth(1)
    for cell in ("12.5 USDC", "pending"):
        expect(first_row.get_by_role("cell", name=cell)).to_be_in_viewport()


def test_pages_before_logging_in(page: Page, stack: Stack, shot: Shot) -> None:
    look_at(page, shot, {"login": "/dashboard/login", "signup": "/dashboard/signup"}, logged_in=False)
    for size, viewport in SIZES.items():  # forms with errors
        page.set_viewport_size(viewport)
        page.goto("/dashboard/signup")
        page.get_by_role("button", name="Create account").click()
        expect(page.get_by_role("alert")).to_be_visible()
        assert audit(page) + violations(page) == []
        shot(page, f"{size}-signup-errors")


def test_log_in_with_the_keyboard_alone(page: Page, stack: Stack) -> None:
    merchant = sign_up(page)
    page.get_by_role("button", name="Log out").click()
    page.goto("/dashboard/login")

    page.keyboard.press("Tab")  # the first stop skips the header
    skip = page.get_by_role("link", name="Skip to main content")
    expect(skip).to_be_focused()
    expect(skip).to_be_in_viewport()
    page.keyboard.press("Enter")
    assert page.evaluate("document.activeElement.id") == "main"

    page.keyboard.press("Tab")
    email = page.get_by_label("Email")
    expect(email).to_be_focused()
    outline: dict[str, Any] = page.evaluate(
        "() => { const s = getComputedStyle(document.activeElement);"
        " return {style: s.outlineStyle, width: parseFloat(s.outlineWidth)}; }"
    )
    assert outline["style"] != "none" and outline["width"] >= 2, outline  # focus is visible
    page.keyboard.type(merchant.email)
    page.keyboard.press("Tab")
    expect(page.get_by_label("Password")).to_be_focused()
    page.keyboard.type(merchant.password)
    page.keyboard.press("Enter")
    expect(page.get_by_role("heading", level=1)).to_have_text("Overview")
