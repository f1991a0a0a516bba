"""Phrase bank for the synthetic ticket generator (data only, no logic).

Kept apart from ``synth.py`` so the generator's logic stays readable. Templates
use ``{slot}`` placeholders filled by ``synth._Slots`` (order numbers, amounts,
error messages, ...), so the same sentence never repeats verbatim.
"""

from __future__ import annotations

# Share of each category in the generated stream (roughly a B2C helpdesk mix).
LABEL_WEIGHTS: dict[str, float] = {
    "technical": 0.30,
    "billing": 0.25,
    "account": 0.20,
    "shipping": 0.15,
    "other": 0.10,
}

GREETINGS = [
    "Hi,",
    "Hello,",
    "Hi there,",
    "Hello support team,",
    "Dear Support,",
    "Hey,",
    "Good morning,",
    "Good afternoon,",
    "Hi team,",
    "To whom it may concern,",
    "Hello {name},",
    "Hi {name},",
]
CLOSINGS = [
    "Thanks.",
    "Thank you.",
    "Thanks in advance.",
    "Thanks for your help.",
    "Regards.",
    "Best regards.",
    "Please advise.",
    "Looking forward to your reply.",
    "Cheers.",
    "Many thanks.",
    "Please get back to me as soon as possible.",
    "Appreciate any help.",
]
SIGNATURES = ["{name}", "{name} {surname}", "-- {name}", "Sent from my iPhone", "{name}, {company}"]

# Sentence endings of exactly 1-4 words, to land a ticket on its sampled length without cutting a sentence.
TAILS: dict[int, list[str]] = {
    1: ["Thanks!", "Urgent.", "Help!", "Thx.", "Please!"],
    2: ["Please help.", "Thanks again.", "Any update?", "Very urgent.", "Thank you!"],
    3: ["Please help me.", "Thanks a lot.", "This is urgent.", "Any ideas, anyone?", "Please reply soon."],
    4: ["Please advise me, thanks.", "I need help urgently.", "Hope you can help.", "Thanks for your time."],
}

# 1-3 word fillers to pad very short tickets up to their sampled length.
FILLERS = [
    "thanks",
    "please",
    "help",
    "urgent",
    "asap",
    "hi",
    "pls help",
    "any update?",
    "thank you",
    "order {order}",
    "need help",
    "still waiting",
]

GENERIC_DETAILS = [
    "I have been a customer for {years} years and this has never happened before.",
    "This is really frustrating.",
    "I already tried contacting you via chat but nobody answered.",
    "Could you please look into this as soon as possible?",
    "My account email is {email} in case you need it.",
    "I have attached a screenshot.",
    "This is the second time I am writing about this.",
    "Please let me know if you need any more information from me.",
    "I need this sorted out before {date}.",
    "Your FAQ did not answer my question.",
    "I'm not sure if this is the right place to ask.",
    "A colleague of mine has the same issue.",
    "My customer number is {customer}.",
    "I called yesterday and was told someone would email me, but nothing came.",
    "If this is not fixed soon I will have to look for another provider.",
    "I would appreciate a quick answer.",
    "Ticket {ticket} was closed without a solution.",
    "Not sure what else to do at this point.",
]

CATEGORIES: dict[str, dict[str, list[str]]] = {
    "billing": {
        "short": [
            "charged twice",
            "refund please",
            "wrong invoice amount",
            "double charge on card",
            "cancel my subscription",
            "where is my refund",
            "invoice {invoice} is wrong",
            "need a VAT invoice",
            "payment failed again",
            "unexpected charge of {amount}",
            "please refund order {order}",
        ],
        "issue": [
            "I was charged twice for my {plan} this month, please refund one of the payments.",
            "There is a charge of {amount} on my card that I don't recognise.",
            "I cancelled my subscription on {date} but I was still billed {amount}.",
            "Can you send me an invoice with our company VAT number for order {order}?",
            "My refund for order {order} still hasn't arrived after {days} days.",
            "The invoice {invoice} shows {amount} but the price on your website was lower.",
            "My card payment keeps failing when I try to renew the {plan}.",
            "Why did the price of the {plan} go up without any notice?",
            "I was promised a discount code but it was not applied at checkout.",
            "Please switch me from monthly to annual billing and refund the difference.",
            "I need a copy of all invoices from last year for my accountant.",
            "I got charged {amount} after the free trial even though I cancelled before it ended.",
        ],
        "detail": [
            "The charge appeared on {date}.",
            "My bank statement shows two transactions of {amount} each.",
            "I paid with a Visa card ending in {last4}.",
            "The payment was made through PayPal.",
            "Our finance team needs the invoice for the quarterly report.",
            "I never authorised the renewal.",
            "The order number is {order}.",
            "I was told the refund would take 5-7 business days, it has been {days}.",
            "The coupon code was {coupon}.",
            "We have {seats} seats on the {plan}, but we were billed for more.",
            "Please cancel auto-renewal as well.",
            "The amount in my account dashboard does not match the invoice.",
        ],
    },
    "technical": {
        "short": [
            "app keeps crashing",
            "error {code} on login page",
            "sync not working",
            "site is down",
            "cannot upload files",
            "export broken",
            "API returns 500",
            "app freezes on startup",
            "notifications stopped working",
            "blank screen after update",
        ],
        "issue": [
            "The app crashes every time I open the settings page on my {device}.",
            'I get the error "{error}" when I try to upload a file.',
            "Since the last update the {app} won't start at all.",
            "The export to CSV feature produces an empty file.",
            "Your API has been returning HTTP {code} for about an hour.",
            "Sync between my {device} and the {app} stopped working yesterday.",
            "The dashboard takes more than a minute to load and then times out.",
            "Push notifications are no longer delivered on my {device}.",
            'I can\'t connect the integration, it says "{error}".',
            "After installing version {version} the {app} shows a blank white screen.",
            "Search returns no results even for items I know exist.",
            "The webhook deliveries to our server are failing with {code}.",
        ],
        "detail": [
            "I'm using version {version} on a {device}.",
            "I already tried reinstalling the app and clearing the cache.",
            "It worked fine until {date}.",
            "Restarting the device did not help.",
            "The error message says: {error}.",
            "It happens on both Wi-Fi and mobile data.",
            "Other apps work fine, so it's not my connection.",
            "I attached the logs below.",
            "Our whole team of {seats} people is affected.",
            "The browser console shows {code} errors.",
            "I tried Chrome and Firefox, same result.",
            "Steps to reproduce: open the app, go to settings, tap on sync.",
        ],
    },
    "account": {
        "short": [
            "can't log in",
            "password reset not working",
            "account locked",
            "delete my account",
            "change my email",
            "2FA code not arriving",
            "locked out",
            "login issue",
            "someone accessed my account",
            "cannot sign up",
        ],
        "issue": [
            "I can't log in, the password reset email never arrives.",
            "My account has been locked after too many login attempts.",
            "Please delete my account and all my personal data.",
            "I want to change the email address on my account to {email}.",
            "I no longer receive the two-factor authentication codes by SMS.",
            "Someone logged into my account from a location I don't recognise.",
            "I'm trying to sign up but it says my email is already registered.",
            "How do I transfer ownership of our workspace to a colleague?",
            "I lost access to my authenticator app and can't get into my account.",
            "My username was changed without my permission.",
            "I need to add another admin user to our company account.",
        ],
        "detail": [
            "My username is {user}.",
            "The account is registered under {email}.",
            "I checked my spam folder already.",
            "I changed my phone number recently.",
            "I got a security alert email on {date}.",
            "I don't remember setting up two-factor authentication.",
            "The login page just reloads without any error.",
            "I need access urgently for work.",
            "I can verify my identity with my last invoice number {invoice}.",
            'It says "invalid credentials" even though the password is correct.',
            "I would like to keep my data but close the account.",
        ],
    },
    "shipping": {
        "short": [
            "where is my package",
            "order {order} not delivered",
            "wrong address",
            "package damaged",
            "tracking not updating",
            "late delivery",
            "item missing from box",
            "change shipping address",
            "parcel lost",
            "delivered to wrong house",
        ],
        "issue": [
            "My package has shown 'in transit' for {days} days, where is it?",
            "The tracking number {tracking} doesn't show any updates since {date}.",
            "The parcel was marked as delivered but I never received it.",
            "I need to change the shipping address for order {order}.",
            "The box arrived damaged and the {product} inside is broken.",
            "One item is missing from my order {order}.",
            "I paid for express shipping but the order took {days} days.",
            "{carrier} says the package was returned to sender, why?",
            "Do you ship to {country}, and how long does it take?",
            "I received someone else's order instead of mine.",
            "The delivery driver left my parcel outside in the rain.",
        ],
        "detail": [
            "The carrier is {carrier}.",
            "Tracking number: {tracking}.",
            "The order number is {order}.",
            "I was home all day and nobody rang the bell.",
            "My address is {address}.",
            "The estimated delivery date was {date}.",
            "I need it for a birthday this weekend.",
            "The {carrier} website just says 'exception'.",
            "My neighbours didn't receive it either.",
            "I ordered a {product}.",
            "Please send a replacement or refund the shipping fee.",
        ],
    },
    "other": {
        "short": [
            "question about pricing",
            "partnership inquiry",
            "great product!",
            "feature request",
            "do you have a student discount",
            "press inquiry",
            "just feedback",
            "hiring?",
            "opening hours?",
            "suggestion",
        ],
        "issue": [
            "Do you offer discounts for non-profit organisations?",
            "I just wanted to say that your support team did a great job last week.",
            "We are interested in a partnership with your company.",
            "Would it be possible to add a dark mode in a future version?",
            "Are you planning to open a store in {city}?",
            "I'm a journalist writing an article about your industry, could I ask a few questions?",
            "What are your opening hours during the holidays?",
            "Do you have an affiliate or referral programme?",
            "I have a suggestion for improving the onboarding.",
            "Is there a student discount?",
            "Could you tell me more about your sustainability policy?",
        ],
        "detail": [
            "We are a team of {seats} people based in {city}.",
            "I think many users would appreciate this.",
            "I found your company through a friend.",
            "Our organisation works with schools in {city}.",
            "Feel free to call me at {phone}.",
            "I'd be happy to jump on a call next week.",
            "Keep up the good work.",
            "Just curious, no rush.",
            "I saw your ad on social media.",
            "Our website is {company_domain}.",
        ],
    },
}

FIRST_NAMES = [
    "Anna",
    "James",
    "Maria",
    "Tom",
    "Priya",
    "Luca",
    "Sofia",
    "Ahmed",
    "Chen",
    "Olga",
    "David",
    "Fatima",
    "Ken",
    "Emma",
]
SURNAMES = ["Smith", "Garcia", "Müller", "Rossi", "Khan", "Nguyen", "Kowalski", "Johnson", "Dubois", "Tanaka"]
COMPANIES = ["Acme Ltd", "Brightside GmbH", "Nordic Foods", "Blue Fern Studio", "Kappa Logistics", "Helios Health"]
PLANS = ["Pro plan", "Team plan", "Basic plan", "annual plan", "Premium subscription", "Business tier"]
DEVICES = ["iPhone 13", "Pixel 7", "Samsung Galaxy S22", "Windows 11 laptop", "MacBook Air", "iPad", "Chromebook"]
APPS = ["mobile app", "desktop client", "web dashboard", "browser extension", "Android app", "iOS app"]
PRODUCTS = [
    "coffee grinder",
    "desk lamp",
    "pair of running shoes",
    "phone case",
    "blender",
    "winter jacket",
    "keyboard",
]
CARRIERS = ["UPS", "DHL", "FedEx", "USPS", "Royal Mail", "DPD", "GLS"]
CITIES = ["Berlin", "Austin", "Lyon", "Manchester", "Toronto", "Madrid", "Melbourne", "Warsaw"]
COUNTRIES = ["Canada", "Norway", "Brazil", "Japan", "Switzerland", "Mexico", "Australia"]
STREETS = ["Main St", "Oak Avenue", "Station Road", "Hauptstraße", "Rue de la Paix", "Elm Street"]
WHEN = ["March 3", "the 14th", "June 21", "May 2", "Friday", "October 30", "January 9", "the 1st", "Tuesday"]

# Error messages for the {error} slot (and the pasted logs of synth_attachments).
ERRORS = [
    "Connection timed out",
    "Internal Server Error",
    "Unable to verify SSL certificate",
    "Unexpected token < in JSON at position 0",
    "Permission denied",
    "Session expired, please log in again",
    "NullPointerException",
    "ECONNRESET",
    "Quota exceeded for this workspace",
    "File too large",
    "Something went wrong. Please try again later",
    "Invalid API key",
    "Out of memory",
    "database is locked",
    "Request failed with status code 502",
]
